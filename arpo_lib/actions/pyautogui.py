"""The pyautogui converter: one action -> the code OSWorld runs (or `WAIT`/`DONE`/`FAIL`).

Where we depart from the original `ui-tars` package's generator: it has scaling bugs (a default
`scale_factor`, scroll points not scaled), drops `wait`, and types through the clipboard. Here
every point goes through the same conversion and is clipped into the screen, `wait` becomes
OSWorld's `'WAIT'`, text is typed with `pyautogui.write` on a `repr()`-escaped literal (so text
cannot break out of the string) and pasted only where pyautogui cannot type it, and the code
holds only whitelisted calls with literal arguments (what `desktop_sandbox.action_code.check_action_code` accepts).
Under ARPO's action rules the converter does what ARPO's does (the package docstring).
"""
from __future__ import annotations

import ast
import math
import re
import warnings

from desktop_sandbox.action_code import (
    DETACH_OUTPUT, MAX_ACTION_SECONDS, MAX_TYPED_CHARS,
)

from arpo_lib.actions.space import (
    ACTION_RULES, KEY_ALIASES, SCROLL_AMOUNT, SCROLL_DIRECTIONS, TYPE_INTERVAL, Action, ActionParseError, _check_keys,
    action_rules,
)

_TYPEABLE = re.compile(r"[\x20-\x7e\n\t]+")
"""What pyautogui.write can type on Linux/X11: it has key names for printable ASCII, newline and
tab, and silently skips everything else ("café 日本語" arrives as "caf ")."""
PASTE_PAUSE_S = 0.2
"""Wait after a paste: the application reads the clipboard asynchronously."""
CLIPBOARD_SETTLE_S = 0.3
"""Wait between the copy and the paste. pyperclip returns when xclip's parent exits, before the
clipboard has changed hands: xclip's background child sends the ownership request when it first
runs, and the application learns of the new owner from an event of its own (Chromium pastes its
cached copy until then). Pasting at once lost the text, or pasted the previous one, in about one
episode of nine on a loaded 2-core machine (tests/test_actions_on_a_screen.py)."""
PASTE_KEYS = ("ctrl", "v")
"""The paste in text fields: GTK, Qt, LibreOffice, Chromium and Electron (VS Code) windows."""
TERMINAL_PASTE_KEYS = ("ctrl", "shift", "v")
"""The paste in a terminal: ctrl+v there is the shell's quoted-insert (the text is lost), and
shift+insert would paste the PRIMARY selection; taking PRIMARY to make it work everywhere would
clear the selection of a GTK text field (the agent's select-then-type would insert instead of
replace: measured in Mousepad), so the environment asks which window has the focus instead."""
TERMINAL_CLASSES = frozenset({"gnome-terminal-server", "gnome-terminal", "org.gnome.console", "kgx", "st",
                              "st-256color", "xfce4-terminal", "konsole", "tilix", "terminator", "kitty", "alacritty",
                              "lxterminal", "mate-terminal", "terminology"})
"""WM_CLASS names (instance or class, lowercased) of the terminal emulators whose paste is
ctrl+shift+v (xterm and urxvt have no key that pastes the clipboard: they are not here)."""
SPECIAL_ACTIONS = {"wait": "WAIT", "finished": "DONE", "call_user": "FAIL", "error_env": "FAIL"}
"""OSWorld's special action strings. call_user means "I cannot do this": OSWorld scores an
infeasible task 1 only when the episode ends with FAIL."""



def _screen_xy(point: tuple[float, float] | None, screen_size: tuple[int, int],
               what: str) -> tuple[int, int]:
    if point is None:
        raise ActionParseError(f"{what} action has no point")
    width, height = screen_size
    x, y = (float(v) for v in point)
    if not (math.isfinite(x) and math.isfinite(y)):
        raise ActionParseError(f"{what}: non-finite point {point!r}")
    # Clip: the model may overshoot the edge slightly; pyautogui must stay on screen.
    return (int(round(min(max(x, 0.0), width - 1))), int(round(min(max(y, 0.0), height - 1))))


def to_pyautogui(action: Action, screen_size: tuple[int, int] = (1920, 1080), *, clipboard: bool = True,
                 paste_keys: tuple[str, ...] = PASTE_KEYS) -> str:
    """OSWorld pyautogui code for one action, or 'WAIT' / 'DONE' / 'FAIL', under the action's
    rules (`Action.rules`).

    Points are taken as screen pixels (OSWorld's screenshot is the screen at full resolution).
    Only calls from :data:`PYAUTOGUI_FUNCTIONS` and ``time.sleep`` appear, all with literal
    arguments. A trailing newline in typed text is pressed as Enter. Horizontal scrolls are
    shift + wheel (pyautogui.hscroll does not work on Linux/X11 in most applications; ARPO's
    rules: nothing). A step that does nothing is ``import pyautogui`` alone.
    Unknown keys raise ActionParseError instead of being dropped, so a bad hotkey counts as a
    format failure rather than silently doing something else.
    `clipboard=False`: the machine has no clipboard tool (`lost_without_clipboard`), so text that
    would be pasted is typed as far as pyautogui can type it. `paste_keys`: the keys that paste in
    the focused window (`paste_keys_for`: a terminal's are ctrl+shift+v).
    """
    rules = action_rules(action.rules)
    kind = action.kind
    if kind in SPECIAL_ACTIONS:
        return SPECIAL_ACTIONS[kind]
    lines = ["import pyautogui"]
    if kind in ("click", "left_double", "right_single", "hover"):
        x, y = _screen_xy(action.point, screen_size, kind)
        func = {"click": "click", "left_double": "doubleClick", "right_single": "rightClick", "hover": "moveTo"}[kind]
        lines.append(f"pyautogui.{func}({x}, {y})")
    elif kind == "drag":
        x1, y1 = _screen_xy(action.point, screen_size, kind)
        x2, y2 = _screen_xy(action.end_point, screen_size, kind)
        lines.append(f"pyautogui.moveTo({x1}, {y1})")
        lines.append(f"pyautogui.dragTo({x2}, {y2}, duration={rules.drag_duration!r}, button='left')")
    elif kind in ("hotkey", "keydown", "keyup"):
        keys = [KEY_ALIASES.get(str(k).lower(), str(k).lower()) for k in action.keys]
        _check_keys(keys, kind)
        if kind != "hotkey":
            if len(keys) != 1:
                raise ActionParseError(f"{kind} takes one key, got {len(keys)}")
            lines.append(f"pyautogui.{'keyDown' if kind == 'keydown' else 'keyUp'}({keys[0]!r})")
        elif keys == ["<"]:
            lines.append(LESS_THAN)
        elif len(keys) == 1:
            lines.append(f"pyautogui.press({keys[0]!r})")
        else:
            lines.append(f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})")
    elif kind == "type":
        lines += _typing(action, clipboard, paste_keys)[0]
    elif kind == "scroll":
        if action.direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(f"scroll direction must be one of {SCROLL_DIRECTIONS}, "
                                   f"got {action.direction!r}")
        amount = SCROLL_AMOUNT if action.direction in ("up", "left") else -SCROLL_AMOUNT
        where = ""
        if action.point is not None:
            x, y = _screen_xy(action.point, screen_size, kind)
            where = f", x={x}, y={y}"
        call = f"pyautogui.scroll({amount}{where})"
        if action.direction in ("left", "right"):
            if rules.sideways_scroll:
                lines += ["pyautogui.keyDown('shift')", call, "pyautogui.keyUp('shift')"]
        else:
            lines.append(call)
    elif kind != "noop":
        raise ActionParseError(f"unknown action kind {kind!r}")
    if any(line.startswith("pyperclip.") for line in lines):
        first = next(i for i, line in enumerate(lines) if line.startswith("pyperclip."))
        lines[first:first] = list(DETACH_OUTPUT)
        lines[1:1] = ["import os", "import pyperclip", "import time"]
    elif any(line.startswith("time.") for line in lines):
        lines[1:1] = ["import time"]
    return "\n".join(lines)


def _type_lines(text: str, clipboard: bool = True, paste_keys: tuple[str, ...] = PASTE_KEYS) -> tuple[list[str], str]:
    """Type `text` (ours): if pyautogui can type all of it, pyautogui.write; otherwise (accents,
    CJK, emoji) the whole text through the clipboard and one paste, as UI-TARS's own code types
    (one paste, not one per run: back-to-back clipboard hand-overs drop characters). A text longer
    than MAX_TYPED_CHARS is pasted too: typed, it would outlast the action's time. A trailing
    newline is an Enter. Without a clipboard, what pyautogui can type of it is typed.
    Returns (the lines, the text left untyped for want of a clipboard)."""
    enter = text.endswith("\n")
    body = text[:-1] if enter else text
    lines, lost = [], ""
    if body and _TYPEABLE.fullmatch(body) and len(body) <= MAX_TYPED_CHARS:
        lines += _written(body)
    elif body and clipboard:
        lines += _paste(body, paste_keys)
    elif body:
        typed, lost = _split_typeable(body)
        lines += _written(typed)
    if enter:
        lines.append("pyautogui.press('enter')")
    return lines, lost


LESS_THAN = "pyautogui.hotkey('shift', ',')"
"""How `<` is typed. pyautogui on X11 types `<` as `>`: it holds shift with the keycode X gives
the keysym `less`, the ISO key whose shifted symbol is `>` (so `wc -l < f` ran `wc -l > f`, a
write). desktop_env rewrites `<` as shift+comma (the VM's US layout) only inside
`pyautogui.typewrite(...)` and `press('<')`, never inside `pyautogui.write(...)`, so it is done
here, where the code is made."""


def _written(text: str) -> list[str]:
    """pyautogui.write calls that type `text` (pyautogui can type all of it), each `<` pressed as
    shift+comma (LESS_THAN)."""
    lines = []
    for i, run in enumerate(text.split("<")):
        if i:
            lines.append(LESS_THAN)
        if run:
            lines.append(f"pyautogui.write({run!r}, interval={TYPE_INTERVAL!r})")
    return lines


def _split_typeable(text: str) -> tuple[str, str]:
    """(what pyautogui.write can type of `text`, at most MAX_TYPED_CHARS; the rest, in order)."""
    typed = "".join(ch for ch in text if _TYPEABLE.fullmatch(ch))[:MAX_TYPED_CHARS]
    lost, i = [], 0
    for ch in text:  # the characters `typed` leaves out, in order
        if i < len(typed) and ch == typed[i]:
            i += 1
        else:
            lost.append(ch)
    return typed, "".join(lost)


def _arpo_typed(text: str) -> tuple[str, bool] | None:
    r"""(what ARPO's generated code types, whether it then presses Enter) for a type action's text,
    or None when its code does not compile (nothing is typed).

    ARPO's converter escapes the text's unescaped single quotes, strips a trailing newline (with
    `rstrip("\\n").rstrip("\n")`, which also eats 'n's and backslashes before a literal `\n`) and
    pastes the rest between single quotes into `pyautogui.write('...')`: Python then reads escape
    sequences in it, and a line break inside ends the string literal (a SyntaxError: the VM runs
    nothing). The same literal is read here with ast.literal_eval, which evaluates nothing: text that
    would make ARPO's code run anything but a write types nothing."""
    escaped = re.sub(r"(?<!\\)'", r"\\'", text)
    enter = escaped.endswith("\n") or escaped.endswith("\\n")
    body = escaped.rstrip("\\n").rstrip("\n") if enter else escaped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes such as "\d" stay as typed, as in the VM
        try:
            value = ast.literal_eval("'" + body + "'")
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    return (value, enter) if isinstance(value, str) else None


def _arpo_type_lines(text: str, clipboard: bool = True,
                     paste_keys: tuple[str, ...] = PASTE_KEYS) -> tuple[list[str], str]:
    """Type `text` as ARPO's converter does: pyautogui.write at its pace (characters pyautogui has
    no key for are skipped in the VM), its pause, then Enter. A text too long to type at that pace
    within an action's time (MAX_ACTION_SECONDS) is typed as ours types it."""
    rules = ACTION_RULES["arpo"]
    typed = _arpo_typed(text) if text else None
    if typed is None:
        return [], ""
    value, enter = typed
    if len(value) * rules.type_interval + rules.type_pause_s > MAX_ACTION_SECONDS or len(value) > MAX_TYPED_CHARS:
        return _type_lines(value + ("\n" if enter else ""), clipboard, paste_keys)
    lines = [f"pyautogui.write({value!r}, interval={rules.type_interval!r})"] if value else []
    lines.append(f"time.sleep({rules.type_pause_s!r})")
    if enter:
        lines.append("pyautogui.press('enter')")
    return lines, ""


def _typing(action: Action, clipboard: bool, paste_keys: tuple[str, ...] = PASTE_KEYS) -> tuple[list[str], str]:
    type_lines = _arpo_type_lines if action_rules(action.rules).write_everything else _type_lines
    return type_lines(action.text or "", clipboard, paste_keys)


def lost_without_clipboard(action: Action) -> str | None:
    """The text a type action would leave untyped on a machine without a clipboard tool (pyperclip
    finds neither xclip nor xsel): None when it does not paste at all (ASCII text; ARPO's rules)."""
    if action.kind != "type":
        return None
    return _typing(action, clipboard=False)[1] or None


def pastes(action: Action) -> bool:
    """Whether the action's code pastes (text pyautogui cannot type): the keys that paste depend
    on the focused window, so the environment asks for it first (`paste_keys_for`)."""
    return action.kind == "type" and any(line.startswith("pyperclip.") for line in _typing(action, True)[0])


def paste_keys_for(wm_class: str | None) -> tuple[str, ...]:
    """The keys that paste the clipboard into the window of WM_CLASS `wm_class` (`instance.Class`,
    as `wmctrl -lx` prints it; None when unknown): ctrl+shift+v in a terminal (ctrl+v there is
    the shell's quoted-insert, and the pasted text was lost), ctrl+v everywhere else."""
    name = (wm_class or "").lower()
    names = {name, name.split(".", 1)[0], name.rsplit(".", 1)[-1]}  # the whole, the instance, the class
    return TERMINAL_PASTE_KEYS if names & TERMINAL_CLASSES else PASTE_KEYS


def _paste(text: str, paste_keys: tuple[str, ...] = PASTE_KEYS) -> list[str]:
    return [f"pyperclip.copy({text!r})", f"time.sleep({CLIPBOARD_SETTLE_S!r})",
            f"pyautogui.hotkey({', '.join(repr(k) for k in paste_keys)})", f"time.sleep({PASTE_PAUSE_S!r})"]
