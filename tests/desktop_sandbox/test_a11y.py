"""The accessibility tree (GET /accessibility): the desktop's AT-SPI tree in the XML that OSWorld's
VM serves, read back by OSWorld's own getter and metric, and bounded against hostile applications.

The reader's walk (a11y_tree.Reading) is tested on fake accessibles everywhere. The rest needs a
desktop sandbox and the system interpreter's pyatspi (Debian's python3-pyatspi, at-spi2-core,
dbus-daemon, dbus-bin): skipped with the missing piece named otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from desktop_sandbox import a11y, confinement
from desktop_sandbox.a11y_tree import NAMESPACES, Gone, Hung, Limits, Reading, tag_for, to_xml
from desktop_sandbox.sandbox import Sandbox, desktop_unavailable

REASON = desktop_unavailable() or a11y.unavailable()
SCREEN = (1280, 800)
ST, ATTR, CP, VAL, ACT = (f"{{{NAMESPACES[p]}}}" for p in ("st", "attr", "cp", "val", "act"))


# ---- the walk, on fake accessibles ---------------------------------------------------------------

@dataclass
class Fake:
    """An accessible as Reading asks for it. `hang`: every call raises Hung; `gone`: Gone."""

    role: str
    name_: str = ""
    children: list["Fake"] = field(default_factory=list)
    states_: list[str] = field(default_factory=lambda: ["visible", "showing", "enabled"])
    attributes_: dict[str, str] = field(default_factory=dict)
    interfaces_: set[str] = field(default_factory=set)
    text_: str = ""
    value_: dict[str, float] = field(default_factory=dict)
    actions_: list[tuple[str, str, str]] = field(default_factory=list)
    pid: int = 0
    hang: bool = False
    gone: bool = False
    columns: int = 0
    calls: list[str] = field(default_factory=list)

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if self.hang:
            raise Hung("Did not receive a reply")
        if self.gone:
            raise Gone("the object is gone")

    def name(self) -> str:
        self._check("name")
        return self.name_

    def role_name(self) -> str:
        self._check("role")
        return self.role

    def states(self) -> list[str]:
        return self.states_

    def attributes(self) -> dict[str, str]:
        return self.attributes_

    def interfaces(self) -> set[str]:
        return self.interfaces_

    def extents(self) -> tuple[int, int, int, int]:
        return (10, 20, 300, 40)

    def text(self, limit: int) -> str:
        self.calls.append(f"text {limit}")
        return self.text_[:limit]

    def value(self) -> dict[str, float]:
        return self.value_

    def actions(self) -> list[tuple[str, str, str]]:
        return self.actions_

    def child_count(self) -> int:
        self._check("count")
        return len(self.children)

    def child(self, index: int) -> "Fake":
        return self.children[index]

    def process_id(self) -> int:
        return self.pid

    def table_rows(self) -> int:
        return len(self.children) // self.columns

    def table_columns(self) -> int:
        return self.columns


def parse(reading: Reading, apps: list[Fake]) -> tuple[str, ET.Element]:
    xml = to_xml(reading.desktop(apps))
    return xml, ET.fromstring(xml)


def test_the_tree_has_osworlds_shape():
    button = Fake("push button", "OK", interfaces_={"Component", "Action", "Image"},
                  actions_=[("click", "press it", "Return"), ("show menu", "", "")])
    field_ = Fake("text", "", states_=["visible", "showing", "editable", "multi_line"], interfaces_={"Text", "Value"},
                  attributes_={"toolkit": "gtk", "xml-roles": "textbox"}, text_="hello\ufffc wor\ufffdld",
                  value_={"value": 3.0, "min": 0.0})
    hidden = Fake("label", "off screen", states_=["enabled"], interfaces_={"Component"})
    frame = Fake("frame", "Doc - Editor", children=[button, field_, hidden], states_=["active", "visible", "showing"],
                 interfaces_={"Component"})
    xml, root = parse(Reading(Limits()), [Fake("application", "editor", [frame]), Fake("application", "empty")])
    head = xml.split(">", 1)[0]
    assert head.startswith("<desktop-frame ") and all(f'xmlns:{p}="{u}"' in head for p, u in NAMESPACES.items())
    assert [a.get("name") for a in root] == ["editor", "empty"] and root.get("truncated") is None
    frame_el = root.find("application/frame")
    assert frame_el.get("name") == "Doc - Editor" and frame_el.get(ST + "active") == "true"
    assert frame_el.get(CP + "screencoord") == "(10, 20)" and frame_el.get(CP + "size") == "(300, 40)"
    ok = frame_el.find("push-button")
    assert ok.get("image") == "true" and ok.get(ACT + "click_desc") == "press it" and ok.get(ACT + "click_kb") == "Return"
    assert ok.get(ACT + "show-menu_desc") == ""
    text = frame_el.find("text")
    assert text.text == "hello world" and text.get(ST + "multi_line") == "true" and text.get(ATTR + "xml-roles") == "textbox"
    assert text.get(VAL + "value") == "3.0" and text.get(VAL + "min") == "0.0" and text.get(CP + "size") is None
    assert frame_el.find("label").get(CP + "screencoord") is None  # not showing: no coordinates (as OSWorld)
    assert list(ok.attrib)[:2] == ["name", ST + "visible"]  # OSWorld's order: name, states, ...


def test_every_limit_cuts_and_says_so():
    def chain(depth: int) -> Fake:
        node = Fake("panel", "leaf")
        for _ in range(depth):
            node = Fake("panel", "", [node])
        return node

    _, root = parse(Reading(Limits(max_depth=5)), [Fake("application", "deep", [chain(20)])])
    assert len(list(root.iter("panel"))) == 4 and "depth limit 5" in root.get("truncated")
    _, root = parse(Reading(Limits(max_depth=5)), [Fake("application", "exactly", [chain(3)])])
    assert len(list(root.iter("panel"))) == 4 and root.get("truncated") is None  # nothing was below
    wide = Fake("application", "wide", [Fake("label", str(i)) for i in range(50)])
    _, root = parse(Reading(Limits(max_children=10)), [wide])
    assert len(root.find("application")) == 10 and "children limit 10" in root.get("truncated")
    _, root = parse(Reading(Limits(max_nodes=20)), [wide, Fake("application", "after")])
    assert len(list(root.iter())) == 21 and "node limit 20" in root.get("truncated")  # 20 and the root
    long = Fake("application", "long", [Fake("text", "t", interfaces_={"Text"}, text_="x" * 5000)])
    _, root = parse(Reading(Limits(max_text_chars=100)), [long])
    assert root.find("application/text").text == "x" * 100 and "text 100" in long.children[0].calls
    xml, root = parse(Reading(Limits(max_output_bytes=4000)), [wide])
    assert len(xml.encode()) < 4000 + 1000 and "output limit 4000 bytes" in root.get("truncated")


def test_a_hung_application_is_left_and_the_others_share_the_time():
    clock = [0.0]

    class Slow(Fake):
        def name(self) -> str:
            clock[0] += 1.0  # one second per node
            return super().name()

    slow = Slow("application", "slow", [Slow("label", str(i)) for i in range(100)])
    hung = Fake("application", "frozen", hang=True, pid=4242)
    half = Fake("application", "half", [Fake("label", "fine"), Fake("label", "stuck", hang=True)])
    reading = Reading(Limits(budget_s=30), started=0.0, clock=lambda: clock[0])
    _, root = parse(reading, [hung, half, slow, Fake("application", "last", [Fake("label", "read")])])
    assert [a.get("name") for a in root] == ["half", "slow", "last"]  # the frozen one left out, the rest read
    assert [e.get("name") for e in root[0]] == ["fine"]  # kept as far as it was read
    assert len(root[1]) < 100 and root[2][0].get("name") == "read"  # the slow one had its share, no more
    cut = root.get("truncated")
    assert "application 0 (pid 4242) did not answer" in cut and "'half' stopped answering" in cut and "time budget" in cut


def test_what_xml_cannot_carry_is_dropped():
    evil = Fake("x<y", "bell\x07 and \ufffe", interfaces_={"Text", "Action"}, text_="nul\x00 esc\x1b",
                attributes_={"ok": "v\x01", "not a name": "x", "a:b": "y", "": "z"}, actions_=[("do it!", "d", "k")])
    _, root = parse(Reading(Limits()), [Fake("application", "app", [evil])])
    node = root.find("application/unknown")
    assert node.get("name") == "bell and " and node.text == "nul esc" and node.get(ATTR + "ok") == "v"
    assert [k for k in node.attrib if k.startswith(ATTR)] == [ATTR + "ok"] and not any(k.startswith(ACT) for k in node.attrib)
    assert tag_for("push button") == "push-button" and tag_for("  ") == "unknown" and tag_for("1st") == "unknown"


def test_a_vanished_node_is_skipped():
    _, root = parse(Reading(Limits()), [Fake("application", "app", [Fake("label", "a"), Fake("label", "b", gone=True),
                                                                    Fake("label", "c")])])
    assert [e.get("name") for e in root[0]] == ["a", "c"] and root.get("truncated") is None


def test_a_spreadsheet_gives_only_the_cells_on_screen():
    """Rows 2-3, columns 1-2 of a 6x5 sheet are on screen (as when Calc is scrolled)."""
    cells = [Fake("table cell", f"{chr(65 + c)}{r + 1}", states_=["visible", "showing"] if 2 <= r <= 3 and 1 <= c <= 2
                  else ["visible"]) for r in range(6) for c in range(5)]
    table = Fake("table", "Sheet1", cells, interfaces_={"Table"}, columns=5)
    doc = Fake("document spreadsheet", "Untitled 1", [table])
    _, root = parse(Reading(Limits()), [Fake("application", "soffice", [Fake("frame", "Calc", [doc])])])
    assert [c.get("name") for c in root.iter("table-cell")] == ["B3", "C3", "B4", "C4"]
    _, root = parse(Reading(Limits()), [Fake("application", "x", [Fake("table", "not a sheet", cells[:7], columns=5)])])
    assert len(list(root.iter("table-cell"))) == 7  # a table elsewhere: its children, as any node's


def test_chromium_is_named_google_chrome_where_it_stands_in_for_it(monkeypatch):
    from desktop_sandbox import a11y_tree

    assert (a11y_tree.GOOGLE_CHROME, *a11y_tree.CHROMIUM_BINARIES) == confinement.CHROMIUM_BINARIES
    exes = {1: "/usr/lib/chromium/chromium", 2: "/usr/bin/python3.11"}
    monkeypatch.setattr(a11y_tree.os, "readlink", lambda path: exes[int(path.split("/")[2])])
    monkeypatch.setattr(a11y_tree.os.path, "exists", lambda path: False)
    apps = [Fake("application", "Chromium", pid=1), Fake("application", "Chromium", pid=2),
            Fake("application", "Google Chrome", pid=2)]
    _, root = parse(Reading(Limits()), apps)
    assert [a.get("name") for a in root] == ["Google Chrome", "Chromium", "Google Chrome"]
    monkeypatch.setattr(a11y_tree.os.path, "exists", lambda path: path == a11y_tree.GOOGLE_CHROME)
    _, root = parse(Reading(Limits()), apps[:1])
    assert root[0].get("name") == "Chromium"  # Google Chrome is installed: it is what google-chrome runs


@pytest.mark.skipif(a11y.unavailable() is not None, reason=a11y.unavailable() or "")
def test_state_names_are_pyatspis():
    code = ("import pyatspi, sys; sys.path.insert(0, sys.argv[1]); from a11y_tree import _state_name\n"
            "from gi.repository import Atspi\n"
            "bad = [(s, _state_name(s)) for s in Atspi.StateType.__enum_values__.values() if _state_name(s) != "
            "pyatspi.StateType._enum_lookup[int(s)].split('_', 1)[1].lower()]\nprint(bad)")
    done = subprocess.run([a11y.SYSTEM_PYTHON, "-I", "-c", code, str(a11y.READER.parent)], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


# ---- a real sandbox ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def desktop():
    if REASON:
        pytest.skip(REASON)
    with Sandbox(SCREEN) as box:
        yield box


@pytest.fixture
def box(desktop):
    desktop.reset_session()
    return desktop


def put(box: Sandbox, path: str, content: str) -> None:
    """A file in the sandbox, written as its user (what the agent could type itself)."""
    done = box.execute(["python3", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", path, content])
    assert done["returncode"] == 0, done


def wait_for_tree(box: Sandbox, check, what: str, timeout: float = 45.0) -> tuple[str, ET.Element]:
    deadline = time.monotonic() + timeout
    while True:
        xml = box.accessibility_tree()
        root = ET.fromstring(xml)
        if check(root):
            return xml, root
        assert time.monotonic() < deadline, f"{what}: not in the tree within {timeout:.0f} s: {xml[:3000]}"
        time.sleep(0.5)


PAGE = "<html><head><title>Local page</title></head><body><h1>Hello</h1><button>Press me</button></body></html>"

OSWORLD_READS = r"""
import json, os, sys, types
import xml.etree.ElementTree as ET
import desktop_env.evaluators as evaluators
# the metrics package's __init__ imports every metric (~8 s): general.py alone, as its own module
metrics = types.ModuleType("desktop_env.evaluators.metrics")
metrics.__path__ = [os.path.join(os.path.dirname(evaluators.__file__), "metrics")]
sys.modules[metrics.__name__] = metrics
from desktop_env.evaluators.metrics.general import check_accessibility_tree
from desktop_env.evaluators.getters.chrome import get_active_url_from_accessTree
xml = open(sys.argv[1]).read()
env = types.SimpleNamespace(controller=types.SimpleNamespace(get_accessibility_tree=lambda: xml))
out = {"url": get_active_url_from_accessTree(env, {"goto_prefix": ""}),
       "editor": check_accessibility_tree(xml, [{"selectors": ["application[name=mousepad] frame[name$='notes.txt - Mousepad']"]}]),
       "page": check_accessibility_tree(xml, [{"xpath": "//application[@name='Google Chrome']//document-web[@name='Local page']"},
                                              {"selectors": ["push-button"], "text": "Press me", "exact": True}])}
try:  # what OSWorld's agents keep of the tree (their linearisers filter with it)
    from mm_agents.accessibility_tree_wrap.heuristic_retrieve import filter_nodes
    out["kept"] = [(n.tag, n.get("name")) for n in filter_nodes(ET.fromstring(xml), "ubuntu")]
except ImportError as e:
    out["kept"] = None
print("RESULT " + json.dumps(out))
"""


def test_an_editor_and_chrome_in_the_tree_as_osworlds_getter_reads_it(box, osworld_python, tmp_path):
    """Mousepad (GTK 3) and the browser as OSWorld's task files start it (`google-chrome
    --remote-debugging-port=1337`): their windows, the editor's text, the address bar holding the
    page's address; OSWorld's own getter (get_active_url_from_accessTree, which looks for
    `application[name=Google Chrome] entry[name=Address and search bar]`) and metric
    (check_accessibility_tree) read it, and its agents' lineariser too."""
    if not any(os.access(p, os.X_OK) for p in confinement.CHROMIUM_BINARIES):
        pytest.skip(f"no Chromium or Google Chrome here ({', '.join(confinement.CHROMIUM_BINARIES)})")
    put(box, "/home/user/notes.txt", "hello a11y\n")
    put(box, "/home/user/page.html", PAGE)
    box.launch(["mousepad", "/home/user/notes.txt"])
    box.launch(["google-chrome", "--remote-debugging-port=1337", "file:///home/user/page.html"])

    def complete(root: ET.Element) -> bool:
        bar = root.find(".//application[@name='Google Chrome']//entry[@name='Address and search bar']")
        page = root.find(".//application[@name='Google Chrome']//document-web[@name='Local page']")
        return bar is not None and bool(bar.text) and page is not None and len(page) > 0 and \
            root.find("application[@name='mousepad']") is not None

    xml, root = wait_for_tree(box, complete, "mousepad's and Chrome's windows")
    assert root.tag == "desktop-frame" and root.get("truncated") is None
    editor = root.find("application[@name='mousepad']")
    assert editor.find("frame").get("name").endswith("notes.txt - Mousepad")
    assert any((e.text or "").startswith("hello a11y") for e in editor.iter()), "the editor's text"
    bar = root.find(".//application[@name='Google Chrome']//entry[@name='Address and search bar']")
    assert bar.text.endswith("/home/user/page.html") and bar.get(ST + "editable") == "true" and bar.get(CP + "size")
    (tmp_path / "tree.xml").write_text(xml)
    done = subprocess.run([osworld_python, "-c", OSWORLD_READS, str(tmp_path / "tree.xml")], capture_output=True,
                          text=True, timeout=300, cwd="/")
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["url"] == bar.text and out["editor"] == 1.0 and out["page"] == 1.0, out
    if out["kept"] is not None:
        assert ["entry", "Address and search bar"] in out["kept"] and ["push-button", "Press me"] in out["kept"], out["kept"]


FROZEN = """
import time, gi
gi.require_version("Gtk", "3.0")
from gi.repository import Gtk, GLib
window = Gtk.Window(title="Frozen")
window.add(Gtk.Entry(text="frozen"))
window.show_all()
GLib.timeout_add(1000, lambda: time.sleep(10**6))  # registered on the bus, then never answers again
Gtk.main()
"""
FLOOD = """
import gi
gi.require_version("Gtk", "3.0")
from gi.repository import Gtk
window = Gtk.Window(title="Flood")
box = Gtk.Box()
for _ in range(4):
    store = Gtk.ListStore(str)
    for i in range(3000):
        store.append(["cell \\x01\\x1b\\ufffe %d" % i])  # characters XML cannot carry
    view = Gtk.TreeView(model=store)
    view.append_column(Gtk.TreeViewColumn("c", Gtk.CellRendererText(), text=0))
    scroll = Gtk.ScrolledWindow()
    scroll.set_size_request(80, 300)
    scroll.add(view)
    box.add(scroll)
window.add(box)
window.show_all()
Gtk.main()
"""


def test_a_hung_and_a_flooding_application_cost_a_reading_its_budget_and_no_more(box):
    """The agent's programs: one that registers on AT-SPI's bus and then never answers, one with
    12,000 table cells (and control characters in them). A reading with a 4 s budget answers in
    time with a well-formed tree that names what it cut and still holds the editor; the server
    answers other requests meanwhile, and a reset ends them all."""
    put(box, "/home/user/frozen.py", FROZEN)
    put(box, "/home/user/flood.py", FLOOD)
    box.launch(["mousepad"])
    box.launch(["/usr/bin/python3", "/home/user/frozen.py"])
    box.launch(["/usr/bin/python3", "/home/user/flood.py"])
    deadline = time.monotonic() + 40
    while {w["title"] for w in box.windows()} < {"Frozen", "Flood", "Untitled 1 - Mousepad"}:
        assert time.monotonic() < deadline, box.launched()
        time.sleep(0.3)
    time.sleep(1.5)  # the frozen one stops answering
    budget = 4.0
    answers = []
    started = time.monotonic()
    reading = __import__("threading").Thread(target=lambda: answers.append(box.accessibility_tree(budget)))
    reading.start()
    while reading.is_alive():
        t = time.monotonic()
        assert box.get_json("/screen_size", timeout=10) == {"width": SCREEN[0], "height": SCREEN[1]}
        assert time.monotonic() - t < 2.0, "the server stalled during a reading"
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    assert answers and elapsed < budget + a11y.GRACE_S, elapsed
    root = ET.fromstring(answers[0])
    cut = root.get("truncated") or ""
    assert "did not answer" in cut and ("children limit" in cut or "time budget" in cut), cut
    assert root.find("application[@name='mousepad']") is not None, (cut, [(a.get("name"), len(list(a.iter()))) for a in root])
    assert box.get_json("/health")["ok"]
    box.reset_session()
    assert ET.fromstring(box.accessibility_tree()).find("application") is None


PLANT = """
set -u
for f in "$1" /opt/arpo/bin/python3; do echo owned > "$f" 2>/dev/null && echo "WROTE $f"; done
for d in ~ /tmp ~/.local/lib/python3.11/site-packages /tmp/gi ~/gi; do
  mkdir -p "$d"; for m in pyatspi.py sitecustomize.py usercustomize.py __init__.py; do
    echo "open('/home/user/pwned', 'a').write('$d/$m\\\\n'); raise SystemExit('owned')" > "$d/$m"; done; done
mkdir -p ~/bin ~/.local/share/dbus-1/services
printf '#!/bin/sh\\necho owned > /home/user/pwned\\n' > ~/bin/python3; cp ~/bin/python3 ~/evil.sh; chmod +x ~/bin/python3 ~/evil.sh
echo 'export PATH=~/bin:$PATH' >> ~/.bashrc
printf '[D-BUS Service]\\nName=org.a11y.Bus\\nExec=/home/user/evil.sh\\n' > ~/.local/share/dbus-1/services/org.a11y.Bus.service
xprop -root -f AT_SPI_BUS 8s -set AT_SPI_BUS unix:path=/tmp/fake-bus
kill $(pidof dbus-daemon at-spi-bus-launcher at-spi2-registryd)
sleep 0.3; rm -rf "$XDG_RUNTIME_DIR/bus" "$XDG_RUNTIME_DIR/at-spi"; echo x > "$XDG_RUNTIME_DIR/bus"; echo x > "$XDG_RUNTIME_DIR/at-spi"; chmod 000 "$XDG_RUNTIME_DIR"
echo planted
"""


def test_the_agent_cannot_replace_the_reader_or_redirect_its_bus(box):
    """What the agent can type: overwrite the reader, plant modules it imports (in the home, /tmp,
    the user site), a python3 earlier on the PATH, a service file for AT-SPI's bus in the home,
    the X root window's AT_SPI_BUS property, end the buses and put files where their sockets go.
    An application started after, in this episode and the next, is in the tree, read by the
    workbench's reader from the real bus, and nothing planted ran."""
    put(box, "/home/user/plant.sh", PLANT)
    done = box.execute(["sh", "/home/user/plant.sh", str(a11y.READER)])
    assert done["output"].strip().endswith("planted") and "WROTE" not in done["output"], done
    for episode in ("this one", "the next one"):  # the X server, /tmp and the X property outlive a reset
        if episode == "the next one":
            box.reset_session()
        time.sleep(0.5)  # the buses ended
        box.launch(["mousepad"])
        xml, root = wait_for_tree(box, lambda r: r.find("application[@name='mousepad']/frame") is not None,
                                  f"mousepad in {episode}")
        assert "owned" not in xml and box.read_file("~/pwned") is None, episode
    assert a11y.READER.read_bytes() == Path(a11y.__file__).with_name("a11y_tree.py").read_bytes()
