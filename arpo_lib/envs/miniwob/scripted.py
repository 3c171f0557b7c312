"""The scripted demonstrator of the MiniWoB++ family: it reads the page's DOM and plans the next turn.

`plan` reads the DOM (the environment's `info["dom_elements"]`, boxes in screenshot pixels) and
returns the next turn as a thought and UI-TARS actions, for `arpo_lib.agent.scripted` to write in
the model's own coordinate convention. It uses only what a screenshot agent can do: coordinate
clicks, typing (a trailing newline presses Enter), hotkeys and `finished()`; never a DOM
reference. It keeps no memory: every decision comes from the DOM of the current page (checkbox
states, field values, focus, the "tampered" flag MiniWoB sets on clicked elements) and the step
index, so it can take over an episode at any step. The family's `EnvFamily` (arpo_lib/envs) points here.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arpo_lib.actions import Action
from arpo_lib.envs.base import Plan

# --------------------------------------------------------------------------------------------
# Reading the page
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Page:
    """The DOM elements of one MiniWoB page (boxes in screenshot pixels)."""

    elements: Sequence[dict[str, Any]]

    def find(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [e for e in self.elements if pred(e)]

    def one(self, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        found = self.find(pred)
        if not found:
            raise ValueError(f"scripted agent: no {what} on the page")
        return found[0]

    def by_id(self, element_id: str) -> dict[str, Any]:
        return self.one(lambda e: e["id"] == element_id, f"element #{element_id}")

    def children(self, parent: dict[str, Any]) -> list[dict[str, Any]]:
        return self.find(lambda e: e["parent"] == parent["ref"])

    def label_of(self, element: dict[str, Any]) -> str:
        """Text beside an input inside its <label> (MiniWoB writes `<label><input>text</label>`)."""
        siblings = self.find(lambda e: e["parent"] == element["parent"] and e is not element)
        return " ".join(e["text"] for e in siblings if e["text"]).strip()

    def widget_of(self, element: dict[str, Any]) -> dict[str, Any] | None:
        """The nearest ancestor with class `widget` (click-widget)."""
        refs = {e["ref"]: e for e in self.elements}
        node = refs.get(element["parent"])
        while node is not None:
            if "widget" in node["classes"].split():
                return node
            node = refs.get(node["parent"])
        return None


def _center(e: dict[str, Any]) -> tuple[float, float]:
    return e["left"] + e["width"] / 2, e["top"] + e["height"] / 2


def _inside(point: tuple[float, float], box: dict[str, Any], margin: float = 0.0) -> bool:
    x, y = point
    return (box["left"] - margin <= x <= box["left"] + box["width"] + margin
            and box["top"] - margin <= y <= box["top"] + box["height"] + margin)


def _free_point(target: dict[str, Any], covers: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """A point of `target` outside every element in `covers` (drawn above it), as far from them
    as possible; the centre when nothing overlaps. Absolutely placed buttons can overlap."""
    center = _center(target)
    if not any(_inside(center, c, margin=4) for c in covers):
        return center
    best, best_score = center, -1.0
    n = 8
    for i in range(1, n):
        for j in range(1, n):
            p = (target["left"] + target["width"] * i / n, target["top"] + target["height"] * j / n)
            if any(_inside(p, c) for c in covers):
                continue
            # distance to the nearest covering box edge: a rounding error must not cross it
            score = min(max(c["left"] - p[0], p[0] - c["left"] - c["width"],
                            c["top"] - p[1], p[1] - c["top"] - c["height"]) for c in covers)
            if score > best_score:
                best, best_score = p, score
    return best


def _quoted(instruction: str) -> list[str]:
    """Strings inside double quotes, in order."""
    return re.findall(r'"([^"]*)"', instruction)


def _click(e: dict[str, Any], point: tuple[float, float] | None = None) -> Action:
    return Action("click", point=point or _center(e))


# --------------------------------------------------------------------------------------------
# Task solvers: (instruction, page, step) -> Plan
# --------------------------------------------------------------------------------------------


def _click_test(instruction: str, page: _Page, step: int) -> Plan:
    return "The task asks me to click the button. I click it.", [_click(page.by_id("subbtn"))]


def _click_button(instruction: str, page: _Page, step: int) -> Plan:
    label = _quoted(instruction)[0]
    button = page.one(lambda e: e["tag"] == "button" and e["text"] == label, f'"{label}" button')
    return f'I need the button labelled "{label}". I click it.', [_click(button)]


def _click_link(instruction: str, page: _Page, step: int) -> Plan:
    text = _quoted(instruction)[0]
    link = page.one(lambda e: "alink" in e["classes"].split() and e["text"] == text, f'link "{text}"')
    return f'The link "{text}" is in the text. I click it.', [_click(link)]


def _focus_text(instruction: str, page: _Page, step: int) -> Plan:
    return "I click into the textbox to focus it.", [_click(page.by_id("tt"))]


def _focus_text_2(instruction: str, page: _Page, step: int) -> Plan:
    m = re.search(r"(\d)(?:st|nd|rd|th) input", instruction)
    if not m:
        raise ValueError(f"scripted agent: cannot read the textbox position in {instruction!r}")
    box = page.by_id(f"tt{m.group(1)}")
    return f"I click into textbox number {m.group(1)} to focus it.", [_click(box)]


def _select_then_submit(instruction: str, page: _Page, tag: str) -> Plan:
    """click-checkboxes / click-option: fix the first box in the wrong state, else Submit."""
    m = re.match(r"Select (.*) and click Submit\.", instruction)
    if not m:
        raise ValueError(f"scripted agent: cannot read the selection in {instruction!r}")
    wanted = set() if m.group(1) == "nothing" else {w.strip() for w in m.group(1).split(",")}
    for box in page.find(lambda e: e["tag"] == tag):
        name = page.label_of(box)
        checked = box["value"] == "True"
        if (name in wanted) != checked:
            verb = "select" if not checked else "unselect"
            return f'"{name}" is not in the right state yet. I {verb} it.', [_click(box)]
    return "Every option is set as asked. I click Submit.", [_click(page.by_id("subbtn"))]


def _click_checkboxes(instruction: str, page: _Page, step: int) -> Plan:
    return _select_then_submit(instruction, page, "input_checkbox")


def _click_option(instruction: str, page: _Page, step: int) -> Plan:
    return _select_then_submit(instruction, page, "input_radio")


def _fill_fields(fields: list[tuple[dict[str, Any], str, str]], submit: dict[str, Any]) -> Plan:
    """Fill text fields in order, then click `submit`. `fields`: (element, wanted text, name).

    A field is clicked before typing unless it already has the focus; from one filled field the
    next is reached with Tab, as a person would.
    """
    for i, (field, text, name) in enumerate(fields):
        if field["value"] == text:
            continue
        if field["focused"]:
            if field["value"]:
                # Selection is invisible in the DOM, so select and retype in one turn.
                return (f'The {name} field holds the wrong text. I select it all and type "{text}".',
                        [Action("hotkey", keys=["ctrl", "a"]), Action("type", text=text)])
            return f'The {name} field has the focus. I type "{text}".', [Action("type", text=text)]
        previous = fields[i - 1][0] if i else None
        if previous is not None and previous["focused"]:
            return f"The focus is still on the previous field. I press Tab to reach the {name} field.", \
                [Action("hotkey", keys=["tab"])]
        return f"I click the {name} field to type into it.", [_click(field)]
    return f'Everything is filled in. I click "{submit["text"]}".', [_click(submit)]


def _enter_text(instruction: str, page: _Page, step: int) -> Plan:
    return _fill_fields([(page.by_id("tt"), _quoted(instruction)[0], "text")], page.by_id("subbtn"))


def _enter_text_2(instruction: str, page: _Page, step: int) -> Plan:
    text = _quoted(instruction)[0]
    text = text.upper() if "upper case" in instruction else text.lower()
    return _fill_fields([(page.by_id("tt"), text, "text")], page.by_id("subbtn"))


def _login_user(instruction: str, page: _Page, step: int) -> Plan:
    user, password = _quoted(instruction)[:2]
    return _fill_fields([(page.by_id("username"), user, "username"),
                         (page.by_id("password"), password, "password")], page.by_id("subbtn"))


def _enter_password(instruction: str, page: _Page, step: int) -> Plan:
    password = _quoted(instruction)[0]
    return _fill_fields([(page.by_id("password"), password, "password"),
                         (page.by_id("verify"), password, "verify password")], page.by_id("subbtn"))


def _click_dialog(instruction: str, page: _Page, step: int) -> Plan:
    close = page.one(lambda e: "ui-dialog-titlebar-close" in e["classes"].split(), "dialog close button")
    return 'The dialog has an "x" in its title bar. I click it to close the dialog.', [_click(close)]


def _click_test_2(instruction: str, page: _Page, step: int) -> Plan:
    one, two = page.by_id("subbtn"), page.by_id("subbtn2")
    return "I click the button labelled ONE.", [_click(one, _free_point(one, [two]))]


def _click_button_sequence(instruction: str, page: _Page, step: int) -> Plan:
    one, two = page.by_id("subbtn"), page.by_id("subbtn2")
    if not one["tampered"]:
        return "First I click button ONE.", [_click(one, _free_point(one, [two]))]
    return "Button ONE is done. Now I click button TWO.", [_click(two)]


def _click_tab(instruction: str, page: _Page, step: int) -> Plan:
    m = re.search(r"Tab #(\d+)", instruction)
    if not m:
        raise ValueError(f"scripted agent: cannot read the tab in {instruction!r}")
    name = f"Tab #{m.group(1)}"
    tab = page.one(lambda e: e["tag"] == "a" and e["text"] == name, name)
    return f"I click the tab titled {name}.", [_click(tab)]


_WIDGET_TAGS = {"radio": "input_radio", "checkbox": "input_checkbox", "text": "input_text",
                "textarea": "textarea", "button": "button"}


def _click_widget(instruction: str, page: _Page, step: int) -> Plan:
    kind = _quoted(instruction)[0]
    tag = _WIDGET_TAGS.get(kind)
    if tag is None:
        raise ValueError(f"scripted agent: unknown widget kind {kind!r}")
    widget = page.one(lambda e: e["tag"] == tag and page.widget_of(e) is not None, f"{kind} widget")
    return f"I click a {kind} widget.", [_click(widget)]


SOLVERS: dict[str, Callable[[str, _Page, int], Plan]] = {
    "click-test": _click_test,
    "click-test-2": _click_test_2,
    "click-button": _click_button,
    "click-button-sequence": _click_button_sequence,
    "click-link": _click_link,
    "click-dialog": _click_dialog,
    "click-tab": _click_tab,
    "click-widget": _click_widget,
    "click-checkboxes": _click_checkboxes,
    "click-option": _click_option,
    "focus-text": _focus_text,
    "focus-text-2": _focus_text_2,
    "enter-text": _enter_text,
    "enter-text-dynamic": _enter_text,
    "enter-text-2": _enter_text_2,
    "enter-password": _enter_password,
    "login-user": _login_user,
}
SCRIPTED_TASKS: tuple[str, ...] = tuple(sorted(SOLVERS))
"""MiniWoB++ tasks the scripted agent solves (names without the `miniwob/` prefix)."""

MAX_SCRIPTED_STEPS = 12
"""After this many steps the agent gives up with finished(): a script that loops is a bug,
and the episode should end rather than run into the environment's step cap silently."""


def task_name(task: str) -> str:
    """'miniwob/click-test-v1' / 'click-test' / 'miniwob/click-test@3' (an instance) -> 'click-test'."""
    return task.removeprefix("miniwob/").partition("@")[0].removesuffix("-v1")


def supports(task: str) -> bool:
    """Whether a task (with or without `miniwob/`, `@<seed>` and `-v1`) has a solver."""
    return task_name(task) in SOLVERS


def plan(task: str, instruction: str, info: dict[str, Any], step: int, screen_size: tuple[int, int]) -> Plan:
    """The next turn on a MiniWoB page (`screen_size` is not needed: the DOM's boxes are in
    screenshot pixels). ValueError for an unsupported task (listing `SCRIPTED_TASKS`) or a page
    the script does not understand."""
    solver = SOLVERS.get(task_name(task))
    if solver is None:
        raise ValueError(f"no scripted agent for task {task!r}; supported: {', '.join(SCRIPTED_TASKS)}")
    if step >= MAX_SCRIPTED_STEPS:
        return "I could not complete the task with my script. I stop here.", [Action("finished")]
    return solver(instruction, _Page(info.get("dom_elements") or []), step)


# Instruction patterns of each task, to find the task from what a rollout context shows.
# Where two tasks share a phrasing the DOM decides (checkbox vs radio), or they share a solver.
_INSTRUCTION_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"^Click the button\.$", "click-test"),
    (r"^Click button ONE\.$", "click-test-2"),
    (r"^Click button ONE, then click button TWO\.$", "click-button-sequence"),
    (r'^Click on the ".*" button\.$', "click-button"),
    (r'^Click on the link ".*"\.$', "click-link"),
    (r'^Close the dialog box by clicking the "x"\.$', "click-dialog"),
    (r"^Click on Tab #\d+\.$", "click-tab"),
    (r'^Click on a ".*" widget\.$', "click-widget"),
    (r"^Focus into the textbox\.$", "focus-text"),
    (r"^Focus into the \d(?:st|nd|rd|th) input textbox\.$", "focus-text-2"),
    (r'^Enter ".*" into the text field and press Submit\.$', "enter-text"),
    (r'^Type ".*" in all (?:upper|lower) case letters in the text input and press Submit\.$',
     "enter-text-2"),
    (r'^Enter the password ".*" into both text fields and press submit\.$', "enter-password"),
    (r'^Enter the username ".*" and the password ".*" into the text fields and press login\.$',
     "login-user"),
    (r"^Select .* and click Submit\.$", "select"),
)


def infer_task(instruction: str, info: dict[str, Any]) -> str:
    """The supported task an instruction (and page) belongs to; ValueError if none matches.

    Tasks whose instructions read alike are either solved the same way (enter-text and
    enter-text-dynamic) or told apart by the page (checkboxes vs radio buttons).
    """
    for pattern, name in _INSTRUCTION_PATTERNS:
        if re.match(pattern, instruction.strip(), re.DOTALL):
            if name == "select":
                tags = {e["tag"] for e in info.get("dom_elements") or []}
                return "click-option" if "input_radio" in tags else "click-checkboxes"
            return name
    raise ValueError(f"no scripted agent recognises the instruction {instruction!r}; "
                     f"supported tasks: {', '.join(SCRIPTED_TASKS)}")

