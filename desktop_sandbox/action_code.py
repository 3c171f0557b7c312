"""What the action server runs: `check_action_code` accepts only code of the shape the
workbench's converter (`arpo_lib.actions.to_pyautogui`) generates, whitelisted pyautogui calls with
literal, bounded arguments, and raises `UnsafeCodeError` on anything else. The server runs nothing
it refuses.

This module is the contract between the two: the calls, keys and bounds below are what the
sandbox accepts, and the converter generates within them (it imports them from here).
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass

# Key names pyautogui understands (a subset of its KEY_NAMES, written out here so that
# generated code never names a key pyautogui would silently ignore).
_NAMED_KEYS = (
    "enter", "return", "tab", "space", "backspace", "delete", "del", "insert", "esc", "escape",
    "shift", "shiftleft", "shiftright", "ctrl", "ctrlleft", "ctrlright", "alt", "altleft",
    "altright", "option", "optionleft", "optionright", "command", "win", "winleft", "winright",
    "fn", "capslock", "numlock", "scrolllock", "up", "down", "left", "right", "home", "end",
    "pageup", "pagedown", "pgup", "pgdn", "printscreen", "prtsc", "prtscr", "prntscrn", "print",
    "pause", "apps", "clear", "help", "select", "execute", "volumeup", "volumedown",
    "volumemute", "playpause", "nexttrack", "prevtrack", "stop", "browserback",
    "browserforward", "browserrefresh", "browserhome", "browsersearch",
    "add", "subtract", "multiply", "divide", "decimal", "separator",
) + tuple(f"f{i}" for i in range(1, 25)) + tuple(f"num{i}" for i in range(10))
_CHAR_KEYS = tuple("abcdefghijklmnopqrstuvwxyz0123456789!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
VALID_KEYS = frozenset(_NAMED_KEYS + _CHAR_KEYS)
"""Key names accepted in hotkey/press actions (after alias mapping)."""

PYAUTOGUI_FUNCTIONS = frozenset({
    "click", "doubleClick", "rightClick", "moveTo", "dragTo", "mouseDown", "mouseUp",
    "hotkey", "press", "write", "typewrite", "scroll", "keyDown", "keyUp",
})
"""The only pyautogui functions generated code calls (plus time.sleep and pyperclip.copy)."""
GENERATED_CALLS = frozenset({("pyautogui", f) for f in PYAUTOGUI_FUNCTIONS} | {("time", "sleep"), ("pyperclip", "copy")})
"""Every (module, function) generated code may call, always with literal arguments."""

DETACH_OUTPUT = (
    "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)",
    "os.dup2(os.open(os.devnull, os.O_WRONLY), 2)",
)
"""Run once before the first clipboard copy. pyperclip hands the text to xclip, which stays in the
background serving the clipboard with the caller's stdout and stderr still open; OSWorld's VM
server runs `python -c` with both piped and waits for them to close, so without this every paste
would hang the step until the server's 120 s timeout (and the client's retries would paste again).
The fork's own agents turn the clipboard off for this reason and lose non-ASCII text instead.
These two exact lines are the only non-call statements generated code contains."""

MAX_ACTION_SECONDS = 45.0
"""What the declared sleeps, drag durations and typing intervals of one action may add up to (the
action server gives an action 60 s)."""
MAX_TYPED_CHARS = 4_000
"""pyautogui.write types at most this many characters (at TYPE_INTERVAL: 40 s); longer texts are
pasted through the clipboard (arpo_lib's converter, `_type_lines`)."""


class UnsafeCodeError(ValueError):
    """Code offered for execution is not what `to_pyautogui` generates (the desktop sandbox's action
    server refuses it)."""


MAX_ACTION_CODE_CHARS = 131_072
"""Code offered for execution is refused above this size (a typed text of MAX_RESPONSE_CHARS
characters, escaped, fits): parsing stays fast, and a body of nested operators cannot exhaust
the parser."""
MAX_ACTION_STATEMENTS = 64
"""Generated code has a few lines per action (at most ~10); more is refused before any is checked."""
MAX_CLIPBOARD_CHARS = 80_000
"""Most characters one clipboard copy may carry (four times the longest response the workbench parses)."""
MAX_SCROLL_CLICKS = 50
MAX_REPEAT = 10
"""Most clicks or presses one call may ask for."""
MAX_KEYS_PER_HOTKEY = 6
_BUTTONS = ("left", "right", "middle")


@dataclass(frozen=True)
class _Signature:
    """What one whitelisted call may look like: positional parameters (in order) and keywords,
    each with a kind checked by `_check_value`; `point` when its first two are a point on the screen."""

    params: tuple[str, ...]
    required: int
    point: bool = False


_SIGNATURES: dict[tuple[str, str], _Signature] = {
    **{("pyautogui", f): _Signature(("x", "y", "clicks", "interval", "button"), 2, point=True)
       for f in ("click", "doubleClick", "rightClick")},
    ("pyautogui", "moveTo"): _Signature(("x", "y", "duration"), 2, point=True),
    ("pyautogui", "dragTo"): _Signature(("x", "y", "duration", "button"), 2, point=True),
    ("pyautogui", "mouseDown"): _Signature(("x", "y", "button"), 0, point=True),
    ("pyautogui", "mouseUp"): _Signature(("x", "y", "button"), 0, point=True),
    ("pyautogui", "press"): _Signature(("keys", "presses", "interval"), 1),
    ("pyautogui", "keyDown"): _Signature(("key",), 1),
    ("pyautogui", "keyUp"): _Signature(("key",), 1),
    ("pyautogui", "write"): _Signature(("message", "interval"), 1),
    ("pyautogui", "typewrite"): _Signature(("message", "interval"), 1),
    ("pyautogui", "scroll"): _Signature(("clicks", "x", "y"), 1),
    ("time", "sleep"): _Signature(("secs",), 1),
    ("pyperclip", "copy"): _Signature(("text",), 1),
}
"""Every call generated code may make, and its parameters (pyautogui's own names). `hotkey` takes
keys only and is checked apart."""
_BOUNDS = {"clicks": (1, MAX_REPEAT), "presses": (1, MAX_REPEAT), "interval": (0, 1.0), "duration": (0, 5.0),
           "secs": (0, 5.0)}


def _literal_arg(node: ast.AST, where: str) -> object:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise UnsafeCodeError(f"{where}: argument is not a literal") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise UnsafeCodeError(f"{where}: non-finite number")
    if not isinstance(value, (int, float, str)) or isinstance(value, bool):
        raise UnsafeCodeError(f"{where}: argument of type {type(value).__name__}")
    return value


def _check_value(name: str, param: str, value: object, where: str) -> float:
    """Check one argument; returns the seconds it adds to the action (sleeps, durations)."""
    if param in ("x", "y"):
        if not isinstance(value, int):
            raise UnsafeCodeError(f"{where}: {param} must be an integer pixel")
        return 0.0
    if param in ("key", "keys"):
        if value not in VALID_KEYS:
            raise UnsafeCodeError(f"{where}: unknown key")
        return 0.0
    if param == "button":
        if value not in _BUTTONS:
            raise UnsafeCodeError(f"{where}: button must be one of {_BUTTONS}")
        return 0.0
    if param in ("message", "text"):
        if not isinstance(value, str):
            raise UnsafeCodeError(f"{where}: {param} must be a string")
        limit = MAX_TYPED_CHARS if param == "message" else MAX_CLIPBOARD_CHARS
        if len(value) > limit:
            raise UnsafeCodeError(f"{where}: {len(value)} characters (at most {limit})")
        return 0.0
    if param == "clicks" and name == "scroll":
        if not isinstance(value, int) or abs(value) > MAX_SCROLL_CLICKS:
            raise UnsafeCodeError(f"{where}: scroll by at most {MAX_SCROLL_CLICKS} clicks")
        return 0.0
    low, high = _BOUNDS[param]
    if not isinstance(value, (int, float)) or not low <= value <= high:
        raise UnsafeCodeError(f"{where}: {param} must be a number in [{low}, {high}]")
    if param in ("clicks", "presses") and not isinstance(value, int):
        raise UnsafeCodeError(f"{where}: {param} must be an integer")
    return float(value) if param in ("duration", "secs") else 0.0


def check_action_code(code: str, screen_size: tuple[int, int]) -> None:
    """Raise UnsafeCodeError unless `code` has the shape `to_pyautogui` produces: imports of
    pyautogui/time/pyperclip/os only, the two fixed output-detaching lines, and whitelisted calls
    (`_SIGNATURES`, `hotkey`) with literal arguments of the right kind and within bounds: points
    on the screen, known keys, at most MAX_REPEAT clicks or presses, bounded durations, and at
    most MAX_ACTION_SECONDS of declared waiting in all. (What runs inside the desktop sandbox: a
    model cannot smuggle other code through it, hold the step, or leave the desktop unusable.)
    Fast on any input: the size and statement count are checked before anything else."""
    if not isinstance(code, str):
        raise UnsafeCodeError("code must be a string")
    if len(code) > MAX_ACTION_CODE_CHARS:
        raise UnsafeCodeError(f"code of {len(code)} characters (at most {MAX_ACTION_CODE_CHARS})")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise UnsafeCodeError(f"not valid Python: {e.msg}") from None
    except (ValueError, UnicodeError, MemoryError, RecursionError) as e:  # null bytes, lone surrogates, deep nesting
        raise UnsafeCodeError(f"not valid Python: {type(e).__name__}") from None
    if len(tree.body) > MAX_ACTION_STATEMENTS:
        raise UnsafeCodeError(f"{len(tree.body)} statements (at most {MAX_ACTION_STATEMENTS})")
    width, height = screen_size
    seconds = 0.0
    for stmt in tree.body:
        where = ast.unparse(stmt)[:80]
        if isinstance(stmt, ast.Import):
            if [(a.name, a.asname) for a in stmt.names] not in ([("pyautogui", None)], [("time", None)],
                                                                [("pyperclip", None)], [("os", None)]):
                raise UnsafeCodeError(f"{where}: only pyautogui, time, pyperclip and os may be imported")
            continue
        if ast.unparse(stmt) in DETACH_OUTPUT:
            continue
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and isinstance(stmt.value.func.value, ast.Name)):
            raise UnsafeCodeError(f"{where}: only module.function(...) calls are allowed")
        call = stmt.value
        owner, name = call.func.value.id, call.func.attr  # type: ignore[attr-defined]
        if (owner, name) not in GENERATED_CALLS:
            raise UnsafeCodeError(f"{where}: {owner}.{name} is not an allowed call")
        if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            raise UnsafeCodeError(f"{where}: * and ** arguments are not allowed")
        args = [_literal_arg(a, where) for a in call.args]
        kwargs = {k.arg: _literal_arg(k.value, where) for k in call.keywords}
        if name == "hotkey":
            if kwargs or not 1 <= len(args) <= MAX_KEYS_PER_HOTKEY or not all(a in VALID_KEYS for a in args):
                raise UnsafeCodeError(f"{where}: hotkey takes 1 to {MAX_KEYS_PER_HOTKEY} known keys")
            continue
        signature = _SIGNATURES[(owner, name)]
        if len(args) > len(signature.params):
            raise UnsafeCodeError(f"{where}: too many arguments")
        bound = dict(zip(signature.params, args))
        for key, value in kwargs.items():
            if key not in signature.params or key in bound:
                raise UnsafeCodeError(f"{where}: unexpected argument {key!r}")
            bound[key] = value
        if any(p not in bound for p in signature.params[:signature.required]):
            raise UnsafeCodeError(f"{where}: missing arguments")
        if ("x" in bound) != ("y" in bound):
            raise UnsafeCodeError(f"{where}: a point needs both x and y")
        for param, value in bound.items():
            seconds += _check_value(name, param, value, where)
        if "x" in bound and not (0 <= bound["x"] < width and 0 <= bound["y"] < height):
            raise UnsafeCodeError(f"{where}: point outside the {width}x{height} screen")
        if name in ("write", "typewrite"):
            seconds += len(bound["message"]) * float(bound.get("interval", 0.0))
        if name in ("press", "click", "doubleClick", "rightClick"):
            seconds += float(bound.get("presses", bound.get("clicks", 1))) * float(bound.get("interval", 0.0))
    if seconds > MAX_ACTION_SECONDS:
        raise UnsafeCodeError(f"the action would wait {seconds:.0f} s (at most {MAX_ACTION_SECONDS:.0f} s)")
