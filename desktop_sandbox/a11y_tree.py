"""The desktop's accessibility tree (AT-SPI), printed on stdout as the XML that OSWorld's VM server
answers `GET /accessibility` with (`{"AT": xml}`). The desktop sandbox's server runs this file
inside the sandbox with the system interpreter (`/usr/bin/python3 -I`, which has python3-pyatspi;
the workbench's interpreter cannot import gi), so it uses the standard library and pyatspi only,
never arpo_lib. What starts the buses and runs it: a11y.py.

The shape is OSWorld's (desktop_env/server/main.py, `_create_atspi_node`; written anew here):
- the root `desktop-frame` declares the eight prefixes of `NAMESPACES` (OSWorld's "ubuntu" map);
  under it one element per application, then per accessible, tagged with its role name, spaces
  as dashes ("push button" -> `push-button`, no role -> `unknown`);
- attributes in OSWorld's order: `name`; `st:<state>="true"` per state; `attr:<key>` per object
  attribute; `cp:screencoord="(x, y)"` and `cp:size="(w, h)"` on visible and showing nodes;
  `image="true"` and `selection="true"` where those interfaces exist; `val:value`, `val:min`,
  `val:max`, `val:step`; `act:<action>_desc` and `act:<action>_kb` per action (spaces as dashes);
- the node's text, U+FFFC and U+FFFD removed, as the element's text;
- at most 50 levels and 1,024 children per node (OSWorld's MAX_DEPTH and MAX_WIDTH), and in a
  spreadsheet's table only the cells on screen (a Calc sheet has 2^34 cells).

How it departs from OSWorld's reader, on purpose:
- Hard caps, because the applications are the agent's and may be hostile or hung: `Limits`
  bounds the nodes, the text and names per node, the output, the time of one D-Bus call and
  of the whole reading. The time budget is shared between the applications (each gets the time
  left divided by the applications left), so one slow or flooding application cannot starve
  the others; an application whose call times out is left as far as it was read. Whatever was
  cut is named in the root's `truncated` attribute (absent when nothing was); the reader never
  hangs and always prints a well-formed tree.
- What XML cannot carry is dropped rather than failing the whole reading (OSWorld's lxml raises
  and its server answers 500): characters XML forbids, attribute and role names that are not XML
  names (an application chooses its object attributes, and its role name when it is not one of
  AT-SPI's).
- Chromium presented as Google Chrome: where Google Chrome is not installed, the sandbox runs
  Debian's Chromium under the name `google-chrome` (confinement.write_python_shim: OSWorld's
  tasks start and end `google-chrome`, its getters read Chrome's profile). The same presentation
  holds here: the application node of that Chromium binary (its process's executable, which the
  bus daemon reports and no application can choose) is named "Google Chrome", as OSWorld's getter
  `get_active_url_from_accessTree` looks for `application[name=Google Chrome]` on x86. Any other
  application keeps the name it gives itself (one calling itself "Google Chrome" included, as on
  OSWorld's VM).
- Applications in the registry's order (OSWorld's thread pool appends them as they finish).

    /usr/bin/python3 -I a11y_tree.py [--budget-s 10] [--max-nodes 30000] ...   (XML on stdout)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, fields
from typing import Any, Iterator

NAMESPACES = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
"""OSWorld's `_accessibility_ns_map["ubuntu"]`: what its server writes and its agents' linearisers
read. (Some of its evaluator code maps the prefixes to `uri:deskat:...` namespaces instead, which
its server never writes: the chrome getters, harmlessly, as their selector uses no prefix;
check_left_panel, and the ARPO fork's check_accessibility_tree, so that their namespaced names
match nothing: docs/desktop.md.)"""
ROOT_TAG = "desktop-frame"
GOOGLE_CHROME = "/opt/google/chrome/chrome"
CHROMIUM_BINARIES = ("/usr/lib/chromium/chromium", "/usr/lib/chromium-browser/chromium-browser")
"""Debian's Chromium, which the sandbox presents as google-chrome when GOOGLE_CHROME is absent (the
same list as confinement.CHROMIUM_BINARIES; a test holds them equal)."""
MIN_CALL_TIMEOUT_MS = 250
"""The call timeout is never cut below this (a busy but live application answers within it)."""
SPREADSHEET_PROBES = 500
"""In a spreadsheet's table, how many rows and columns are probed for the first cell on screen
(OSWorld's reader gives up after 500 as well)."""


@dataclass(frozen=True)
class Limits:
    """What one reading may cost. Every field is a command-line option (`--max-nodes` ...)."""

    max_depth: int = 50
    """Levels, the application's counted as the first (OSWorld's MAX_DEPTH)."""
    max_children: int = 1024
    """Children read per node (OSWorld's MAX_WIDTH)."""
    max_nodes: int = 30000
    """Elements in the whole tree (a browser page with a long table has ~10,000)."""
    max_text_chars: int = 20000
    """Characters of one node's text (asked for no more: a hostile text is never transferred)."""
    max_name_chars: int = 2000
    """Characters of a name, an attribute value or an action's description."""
    max_output_bytes: int = 8 * 2**20
    """Bytes of the printed XML (counted as it grows, escaping included)."""
    budget_s: float = 10.0
    """Seconds for the whole reading; past it the tree is printed as far as it got."""
    call_timeout_ms: int = 2000
    """One D-Bus call to an application; past it the application counts as hung (AT-SPI's own
    default gives a newly seen application 15 s per call, and every application is new to a
    fresh reader). Shortened to an application's share of the budget where that is less (not
    below MIN_CALL_TIMEOUT_MS): a call cannot be interrupted, so this bounds what one hung
    application takes from the others."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive")


class Hung(Exception):
    """An application did not answer a call within the call timeout."""


class Gone(Exception):
    """An accessible that vanished or refused a call (a window closed while it was read)."""


# ---- what XML can carry -------------------------------------------------------------------------

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_XML_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*\Z")


def clean(text: str, limit: int) -> str:
    """`text` without the characters XML 1.0 forbids, at most `limit` characters."""
    return _NOT_XML.sub("", text[:limit])


def tag_for(role_name: str) -> str:
    """An element name for a role name, as OSWorld's server makes it ("push button" ->
    "push-button"); "unknown" for no role and for any role name XML cannot carry."""
    tag = (role_name.strip() or "unknown").replace(" ", "-")
    return tag if _XML_NAME.match(tag) else "unknown"


def _qualified(prefix: str, local: str) -> str | None:
    return f"{{{NAMESPACES[prefix]}}}{local}" if _XML_NAME.match(local) else None


def _cost(text: str) -> int:
    """Bytes `text` takes in the output, escaping included (an upper bound)."""
    return len(text.encode("utf-8", "replace")) + 5 * sum(text.count(c) for c in '&<>"\n\r\t')


# ---- the tree -----------------------------------------------------------------------------------

class Reading:
    """One walk of the desktop under `limits`, started at `started` (time.monotonic()): builds
    the elements and records why anything was left out."""

    def __init__(self, limits: Limits, started: float | None = None, clock: Any = time.monotonic,
                 set_call_timeout: Any = lambda ms: None) -> None:
        self.limits, self.clock, self.set_call_timeout = limits, clock, set_call_timeout
        self.deadline = (clock() if started is None else started) + limits.budget_s
        self.nodes = 0
        self.size = 0
        self.cut: list[str] = []
        """Why the tree is incomplete, in the order it happened (no duplicates)."""
        self.full = False
        """The node or output limit was reached: nothing more is read."""

    def note(self, reason: str) -> None:
        if reason not in self.cut:
            self.cut.append(reason)

    def desktop(self, applications: list[Any]) -> ET.Element:
        """The root element with one child per application, each read within its share of the budget."""
        root = ET.Element(ROOT_TAG)
        for index, app in enumerate(applications):
            now = self.clock()
            if now >= self.deadline:
                self.note(f"time budget {self.limits.budget_s:g} s: {len(applications) - index} application(s) not read")
                break
            if self.full:
                break
            share = (self.deadline - now) / (len(applications) - index)
            timeout_ms = int(min(self.limits.call_timeout_ms, max(MIN_CALL_TIMEOUT_MS, 1000 * share)))
            self.set_call_timeout(timeout_ms)
            try:
                element = self.node(app, 1, None, now + share, application=True)
            except Hung:
                element = None
                self.note(f"application {index} ({_process(app)}) did not answer within {timeout_ms} ms")
            if element is not None:
                root.append(element)
        if self.cut:
            root.set("truncated", "; ".join(self.cut))
        return root

    def node(self, node: Any, depth: int, flag: str | None, until: float,
             application: bool = False) -> ET.Element | None:
        """The element of one accessible and, within the limits, of its descendants; None when it
        vanished while being read. Raises Hung, which abandons the application: its element is
        kept as far as it was read."""
        try:
            element, text_of_node, role = self._element(node, application)
        except Gone:
            return None
        if not self._count(element, text_of_node):
            return None
        if not flag and role == "document spreadsheet":
            flag = "calc"
        if depth >= self.limits.max_depth:
            try:
                if node.child_count() > 0:
                    self.note(f"depth limit {self.limits.max_depth}")
            except Gone:
                pass
            return element
        children = self._visible_cells(node, until) if flag == "calc" and role == "table" else self._children(node)
        try:
            for child in children:
                if self.full:
                    break
                if self.clock() >= until:
                    self.note(f"time budget {self.limits.budget_s:g} s")
                    break
                sub = self.node(child, depth + 1, flag, until)
                if sub is not None:
                    element.append(sub)
        except Gone:
            pass  # children that vanished while being listed: the ones read are kept (as OSWorld does)
        except Hung:
            if not application:
                raise
            self.note(f"application {element.get('name')!r} stopped answering")
        return element

    def _count(self, element: ET.Element, text: str) -> bool:
        """Add the element to the totals; False (and the tree is full) when it would pass a limit."""
        size = 2 * len(element.tag) + 5 + _cost(text) + sum(len(k) + 4 + _cost(v) for k, v in element.attrib.items())
        if self.nodes + 1 > self.limits.max_nodes:
            self.note(f"node limit {self.limits.max_nodes}")
            self.full = True
            return False
        if self.size + size > self.limits.max_output_bytes:
            self.note(f"output limit {self.limits.max_output_bytes} bytes")
            self.full = True
            return False
        self.nodes += 1
        self.size += size
        return True

    def _element(self, node: Any, application: bool) -> tuple[ET.Element, str, str]:
        """(element, its text, the raw role name), in OSWorld's attribute order."""
        limits = self.limits
        role = node.role_name().strip()  # first: AT-SPI raises its timeout (get_name answers "" instead)
        name = clean(node.name(), limits.max_name_chars)
        if application and name == "Chromium" and _presented_as_google_chrome(node.process_id()):
            name = "Google Chrome"
        attrib = {"name": name}
        states = node.states()
        for state in states:
            key = _qualified("st", state)
            if state and key:
                attrib[key] = "true"
        for key, value in node.attributes().items():
            qualified = _qualified("attr", key)
            if qualified:
                attrib[qualified] = clean(value, limits.max_name_chars)
        interfaces = node.interfaces()
        if "Component" in interfaces and "visible" in states and "showing" in states:
            x, y, width, height = node.extents()
            attrib[_qualified("cp", "screencoord")] = str((x, y))
            attrib[_qualified("cp", "size")] = str((width, height))
        text = ""
        if "Text" in interfaces:
            text = clean(node.text(limits.max_text_chars), limits.max_text_chars).replace("\ufffc", "").replace("\ufffd", "")
        if "Image" in interfaces:
            attrib["image"] = "true"
        if "Selection" in interfaces:
            attrib["selection"] = "true"
        if "Value" in interfaces:
            for key, value in node.value().items():
                attrib[_qualified("val", key)] = str(value)
        if "Action" in interfaces:
            for action, description, binding in node.actions():
                action = action.replace(" ", "-")
                for suffix, value in (("_desc", description), ("_kb", binding)):
                    qualified = _qualified("act", action + suffix)
                    if qualified:
                        attrib[qualified] = clean(value, limits.max_name_chars)
        element = ET.Element(tag_for(role), attrib)
        if text:
            element.text = text
        return element, text, role

    def _children(self, node: Any) -> Iterator[Any]:
        count = node.child_count()
        if count > self.limits.max_children:
            self.note(f"children limit {self.limits.max_children}")
        for index in range(min(count, self.limits.max_children)):
            child = node.child(index)
            if child is not None:
                yield child

    def _visible_cells(self, table: Any, until: float) -> Iterator[Any]:
        """A spreadsheet's cells on screen, row by row (what OSWorld's reader keeps of a Calc sheet):
        the first showing cell among the first SPREADSHEET_PROBES rows and columns, then in each
        row the showing cells from that column on, until a row starts with one not showing."""
        columns, rows = table.table_columns(), table.table_rows()

        def showing(row: int, column: int) -> Any:
            cell = table.child(row * columns + column)
            return cell if cell is not None and "showing" in cell.states() else None

        first = None
        for row in range(rows):
            if first is None:  # still looking for the first cell on screen
                if row >= SPREADSHEET_PROBES:
                    return
                for column in range(min(columns, SPREADSHEET_PROBES)):
                    if self.clock() >= until:
                        return
                    if showing(row, column) is not None:
                        first = column
                        break
                else:
                    continue
            column = first
            while column < columns and (cell := showing(row, column)) is not None:
                yield cell
                column += 1
            if column == first:
                return


def _process(node: Any) -> str:
    """"pid N, /path/to/its/executable" of an application (the bus daemon answers, not the application)."""
    try:
        pid = node.process_id()
    except (Gone, Hung):
        return "pid unknown"
    try:
        return f"pid {pid}, {os.readlink(f'/proc/{pid}/exe')}"
    except OSError:
        return f"pid {pid}"


def _presented_as_google_chrome(pid: int) -> bool:
    """Whether process `pid` is Debian's Chromium standing in for Google Chrome (see the docstring)."""
    if os.path.exists(GOOGLE_CHROME):
        return False
    try:
        return os.readlink(f"/proc/{pid}/exe") in CHROMIUM_BINARIES
    except OSError:
        return False


def to_xml(root: ET.Element) -> str:
    """The tree as text, the root declaring every prefix of NAMESPACES in their order (as lxml writes
    OSWorld's tree; ElementTree would declare only those used, in its own order)."""
    for prefix, uri in NAMESPACES.items():
        ET.register_namespace(prefix, uri)
    text = ET.tostring(root, encoding="unicode")
    head, rest = text[len(ROOT_TAG) + 1:].split(">", 1) if ">" in text else (text, "")
    head = re.sub(r' xmlns:[a-z]+="[^"]*"', "", head)
    declared = "".join(f' xmlns:{p}="{u}"' for p, u in NAMESPACES.items())
    return f"<{ROOT_TAG}{declared}{head}>{rest}"


# ---- AT-SPI -------------------------------------------------------------------------------------

HUNG_SIGNS = ("did not receive a reply", "timeout", "timed out", "noreply")
"""How libatspi's and D-Bus's errors say that the application did not answer in time."""


class AtspiNode:
    """An accessible as `Reading` asks for it, over pyatspi's Atspi objects; GLib errors become
    Hung (a call that timed out) or Gone (anything else)."""

    def __init__(self, accessible: Any) -> None:
        self.accessible = accessible

    def _call(self, function: Any, *args: Any) -> Any:
        try:
            return function(self.accessible, *args)
        except Exception as e:  # noqa: BLE001 - GLib.Error, and whatever a broken application provokes
            text = str(e)
            if any(sign in text.lower() for sign in HUNG_SIGNS):
                raise Hung(text) from None
            raise Gone(text) from None

    def name(self) -> str:
        return self._call(Atspi.Accessible.get_name) or ""

    def role_name(self) -> str:
        return self._call(Atspi.Accessible.get_role_name) or ""

    def states(self) -> list[str]:
        state_set = self._call(Atspi.Accessible.get_state_set)
        return [_state_name(s) for s in state_set.get_states()]

    def attributes(self) -> dict[str, str]:
        return dict(self._call(Atspi.Accessible.get_attributes) or {})

    def interfaces(self) -> set[str]:
        return set(self._call(Atspi.Accessible.get_interfaces) or ())

    def extents(self) -> tuple[int, int, int, int]:
        box = self._call(lambda a: Atspi.Component.get_extents(a, Atspi.CoordType.SCREEN))
        return box.x, box.y, box.width, box.height

    def text(self, limit: int) -> str:
        count = self._call(Atspi.Text.get_character_count)
        return self._call(Atspi.Text.get_text, 0, min(count, limit)) or ""

    def value(self) -> dict[str, float]:
        out = {}
        for key, getter in (("value", Atspi.Value.get_current_value), ("min", Atspi.Value.get_minimum_value),
                            ("max", Atspi.Value.get_maximum_value), ("step", Atspi.Value.get_minimum_increment)):
            try:
                out[key] = float(self._call(getter))
            except Gone:
                continue
        return out

    def actions(self) -> list[tuple[str, str, str]]:
        out = []
        for index in range(self._call(Atspi.Action.get_n_actions)):
            out.append((self._call(Atspi.Action.get_action_name, index) or "",
                        self._call(Atspi.Action.get_action_description, index) or "",
                        self._call(Atspi.Action.get_key_binding, index) or ""))
        return out

    def child_count(self) -> int:
        count = int(self._call(Atspi.Accessible.get_child_count))
        if count < 0:  # AT-SPI's answer when the call failed (it does not raise)
            raise Gone("no child count")
        return count

    def child(self, index: int) -> "AtspiNode | None":
        found = self._call(Atspi.Accessible.get_child_at_index, index)
        return AtspiNode(found) if found is not None else None

    def process_id(self) -> int:
        return int(self._call(Atspi.Accessible.get_process_id))

    def table_rows(self) -> int:
        return max(0, int(self._call(Atspi.Table.get_n_rows)))

    def table_columns(self) -> int:
        return max(1, int(self._call(Atspi.Table.get_n_columns)))


def _state_name(state: Any) -> str:
    """OSWorld's state names: pyatspi's STATE_MULTI_LINE -> "multi_line"."""
    return state.value_name.split("_STATE_", 1)[-1].lower() if hasattr(state, "value_name") else str(state)


Atspi: Any = None


def read_desktop(limits: Limits, started: float) -> ET.Element:
    """The whole desktop's tree from the accessibility bus (AT_SPI_BUS_ADDRESS, else AT-SPI's own
    lookup)."""
    global Atspi
    import pyatspi  # noqa: F401 - what the system interpreter must have (python3-pyatspi); it loads Atspi
    from gi.repository import Atspi as atspi

    Atspi = atspi
    Atspi.set_timeout(limits.call_timeout_ms, limits.call_timeout_ms)
    desktop = AtspiNode(Atspi.get_desktop(0))
    reading = Reading(limits, started, set_call_timeout=lambda ms: Atspi.set_timeout(ms, ms))
    try:
        applications = list(reading._children(desktop))
    except (Gone, Hung) as e:
        raise RuntimeError(f"the accessibility registry did not answer: {e}") from None
    return reading.desktop(applications)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Limits):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    try:
        root = read_desktop(limits, started)
    except (ImportError, ValueError) as e:
        print(f"cannot read the accessibility tree: {e}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 2
    sys.stdout.write(to_xml(root))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
