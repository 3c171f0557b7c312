"""UI-TARS actions: parse model text into typed actions, format them back, convert to pyautogui.

A UI-TARS assistant turn reads ``Thought: ...`` then ``Action: click(start_box='(x,y)')``
(several actions may follow one ``Action:``). :func:`parse_response` turns that text into
:class:`Action` objects whose points are in SCREENSHOT pixels; :func:`format_action` /
:func:`format_response` write them back in the model's own convention; :func:`to_pyautogui`
turns one action into the code string (or ``'WAIT'``/``'DONE'``/``'FAIL'``) that OSWorld runs.

Coordinate conventions (``coord_mode``):

- ``"qwen25vl"`` (UI-TARS-1.5-7B, the ARPO checkpoint): the model sees the screenshot AFTER the
  processor's :func:`smart_resize` (multiples of ``factor``=28, total pixels in
  [``min_pixels``, ``max_pixels``]) and answers in absolute pixels of that resized image, so
  ``x_screen = x / resized_width * width``. A 1920x1080 screenshot becomes 1932x1092.
- ``"qwen2vl"`` (UI-TARS 1.0 / UI-TARS-2B-SFT): relative coordinates on a 0..1000 grid per axis,
  ``x_screen = x / 1000 * width``.
  Using the wrong mode mis-scales every click (the community replication ran the 2B Qwen2-VL
  model with the 1.5 convention); the mode is therefore a required, validated choice.

Where we depart from the original ``ui-tars`` package (``action_parser.py``):

- It parses the action with ``ast`` on model text; we use a small hand-written scanner, so
  untrusted output is never evaluated and cannot trigger catastrophic regex backtracking.
  Input is capped at :data:`MAX_RESPONSE_CHARS`.
- Its pyautogui generator has scaling bugs (a default ``scale_factor``, scroll points not
  scaled), drops ``wait``, and types through the clipboard. Here every point goes through the
  same conversion, ``wait`` becomes OSWorld's ``'WAIT'``, and text is typed with
  ``pyautogui.write`` on a ``repr()``-escaped literal (so text cannot break out of the string).
- Generated code holds only whitelisted pyautogui/time calls with literal arguments, coordinates
  clipped into the screen, and key names from :data:`VALID_KEYS`.

Lenient parsing choices (documented because they widen what counts as "valid format"):
``Reflection:``/``Action_Summary:`` preambles, repeated ``Action:`` labels, trailing
``<|im_end|>``, quoted or unquoted argument values, and an unescaped quote inside a quoted
value when it is not followed by ``,`` or ``)`` are all accepted.

Action rules (``rules``, :data:`ACTION_RULES`): which action names are valid and how an action is
carried out. ``"workbench"`` (ours, the default and the `run` protocol's) is described above.
``"arpo"`` is what ARPO's training rollouts (verl/trainer/gui_agent.py) and the ARPO authors'
OSWorld fork's UI-TARS agent (mm_agents/uitars_agent.py) do, both with the same converter
(`parsing_response_to_pyautogui_code`, input_swap off); the `arpo_train` and `osworld_uitars`
evaluation protocols use it, so their numbers compare with ARPO's:

- names: ``left_single`` is a click, ``hover`` moves the mouse, ``select`` is a drag,
  ``keydown``/``keyup`` hold/release one key, ``error_env`` is FAIL; any other call
  (``open_app(...)``, ``release(...)``) is a no-op step, not a format failure. ``press`` makes the
  converter raise (it reads a variable only the hotkey branch sets): :class:`ConverterError`, a
  format failure in ARPO's training, a lost episode in the fork's runner.
- a response whose actions include ``finished``/``wait``/``error_env``/``call_user`` runs only the
  first of those (the converter returns at the first one, dropping the other actions).
- typing: everything through ``pyautogui.write(text, interval=0.1)`` then ``time.sleep(0.5)``
  (pyautogui skips characters it has no key for: "café" arrives as "caf"); a text with a line
  break before its end gives ARPO's converter a string literal Python cannot compile, so nothing
  is typed (a no-op here).
- drag over 1.0 s; scroll left/right (or in no readable direction) does nothing.
Keys and arguments are read as ours in both (aliases mapped, unknown keys refused).
"""
from __future__ import annotations

import ast
import math
import re
import warnings
from dataclasses import dataclass, field

ACTION_KINDS = (
    "click", "left_double", "right_single", "drag", "hotkey", "type", "scroll",
    "wait", "finished", "call_user", "error_env", "hover", "keydown", "keyup", "noop",
)
"""Every Action kind. The last four come only from the "arpo" rules (ARPO's converter knows those
names; `noop` is a call it does not recognise, run as nothing)."""

MIN_PIXELS = 3136
"""Smallest image (in pixels) the processor produces: 56 x 56."""
MAX_PIXELS = 2116800
"""ARPO's processor max_pixels: 1920x1080 screenshots are resized to 1932x1092."""
MAX_RESPONSE_CHARS = 20_000
"""Longer responses are rejected outright: no real action needs that much text."""
COORD_MODES = ("qwen25vl", "qwen2vl")
QWEN2VL_GRID = 1000
"""Qwen2-VL UI-TARS models answer on a 0..1000 grid per axis."""
MAX_COORD_FACTOR = 10
"""A coordinate beyond this many times the model's coordinate space is a format error;
slightly beyond the image is allowed (the model may overshoot) and clipped in to_pyautogui."""
SCROLL_DIRECTIONS = ("up", "down", "left", "right")
SCROLL_AMOUNT = 5
"""Wheel clicks per scroll action (the amount OSWorld's UI-TARS agent uses). Up is positive."""
TYPE_INTERVAL = 0.01
"""Seconds between typed characters in pyautogui.write (ours; ARPO's converter: 0.1)."""
DRAG_DURATION = 0.5
"""Seconds the drag takes (a drag with zero duration is missed by some applications; ARPO's: 1.0)."""

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
KEY_ALIASES = {
    "control": "ctrl", "arrowup": "up", "arrowdown": "down", "arrowleft": "left",
    "arrowright": "right", "page_up": "pageup", "page_down": "pagedown", "pgdown": "pgdn",
    "spacebar": "space", "cmd": "command", "meta": "win", "super": "win", "windows": "win",
    "bksp": "backspace", "ins": "insert", "plus": "+", "minus": "-",
}
"""Spellings models use for keys pyautogui names differently. On OSWorld's Ubuntu the
meta/super key is pyautogui's 'win'."""

# Special tokens models wrap boxes in; removed before reading the numbers.
_BOX_TOKENS = ("<|box_start|>", "<|box_end|>", "<point>", "</point>", "<bbox>", "</bbox>")
_TRAILING_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_SEPARATORS = re.compile(r"[\s,]+")
_ACTION_LABEL = re.compile(r"^[ \t]*Action[ \t]*:", re.MULTILINE)
_REPEATED_LABEL = re.compile(r"Action[ \t]*:")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}

# Argument names per action: each field maps to the spellings UI-TARS versions use.
_POINT_ARGS = ("start_box", "point", "start_point")
_END_ARGS = ("end_box", "end_point")
_ARG_SPEC: dict[str, dict[str, tuple[str, ...]]] = {
    "click": {"point": _POINT_ARGS},
    "left_double": {"point": _POINT_ARGS},
    "right_single": {"point": _POINT_ARGS},
    "drag": {"point": _POINT_ARGS, "end_point": _END_ARGS},
    "hotkey": {"keys": ("key", "hotkey", "keys")},
    "press": {"keys": ("key",)},
    "type": {"text": ("content", "text")},
    "scroll": {"point": _POINT_ARGS, "direction": ("direction",)},
    "wait": {},
    "finished": {"text": ("content",)},
    "call_user": {},
    "error_env": {},
    # names only the "arpo" rules read (ARPO's converter knows them)
    "left_single": {"point": _POINT_ARGS},
    "hover": {"point": _POINT_ARGS},
    "select": {"point": _POINT_ARGS, "end_point": _END_ARGS},
    "keydown": {"keys": ("key",)},
    "keyup": {"keys": ("key",)},
}
_REQUIRED = {
    "click": ("point",), "left_double": ("point",), "right_single": ("point",),
    "drag": ("point", "end_point"), "hotkey": ("keys",), "press": ("keys",),
    "type": ("text",), "scroll": ("direction",),
    "left_single": ("point",), "hover": ("point",), "select": ("point", "end_point"),
    "keydown": ("keys",), "keyup": ("keys",),
}
_OUR_NAMES = frozenset({"click", "left_double", "right_single", "drag", "hotkey", "press", "type", "scroll",
                        "wait", "finished", "call_user", "error_env"})
"""The action names the workbench's rules read (`press` as a one-key hotkey)."""
FINAL_KINDS = ("finished", "wait", "call_user", "error_env")
"""Kinds that answer OSWorld with DONE / WAIT / FAIL instead of code."""


class ActionParseError(ValueError):
    """The model's text is not a valid UI-TARS response (a format failure, never a crash)."""


class ConverterError(ActionParseError):
    """The response parses, but the rules' converter raises on one of its actions (ARPO's on
    `press`). A format failure in ARPO's training; the fork's evaluation runner loses the episode
    (its agent raises outside the parse-and-resample loop, the runner writes no result)."""


@dataclass(frozen=True)
class ActionRules:
    """Which action names a response may use and how an action is carried out (see the module
    docstring, "Action rules"). Everything else (boxes, keys, argument names, quoting) is read
    the same way under every rules."""

    name: str
    extra_names: dict[str, str] = field(default_factory=dict, hash=False)
    """Names read beyond ours, and the kind each becomes."""
    unknown_names_are_noops: bool = False
    """A call of any other name is a step that does nothing (False: a format failure)."""
    raising_names: frozenset[str] = frozenset()
    """Names the converter raises on (ConverterError) when it reaches them."""
    final_action_alone: bool = False
    """A response with a finished/wait/call_user/error_env runs that action alone, the first one."""
    type_interval: float = TYPE_INTERVAL
    """Seconds between typed characters."""
    type_pause_s: float = 0.0
    """Sleep after typing, before the Enter of a trailing newline."""
    write_everything: bool = False
    """Type every text with pyautogui.write as ARPO's converter builds the call (see _arpo_typed);
    False: text pyautogui cannot type is pasted through the clipboard."""
    drag_duration: float = DRAG_DURATION
    sideways_scroll: bool = True
    """Scroll left/right as shift + wheel (False: such a scroll does nothing)."""

    def reads(self, name: str) -> bool:
        """Whether a call of this name is an action (or a no-op) rather than a format failure."""
        return (name in _OUR_NAMES or name in self.extra_names or name in self.raising_names
                or self.unknown_names_are_noops)


ACTION_RULES: dict[str, ActionRules] = {
    "workbench": ActionRules("workbench"),
    # ARPO's converter, verl/trainer/gui_agent.py `parsing_response_to_pyautogui_code` (the fork's
    # mm_agents/uitars_agent.py has the same function), with input_swap=False as both call it
    "arpo": ActionRules("arpo", extra_names={"left_single": "click", "hover": "hover", "select": "drag",
                                             "keydown": "keydown", "keyup": "keyup"},
                        unknown_names_are_noops=True, raising_names=frozenset({"press"}), final_action_alone=True,
                        type_interval=0.1, type_pause_s=0.5, write_everything=True, drag_duration=1.0,
                        sideways_scroll=False),
}
"""Action rules by name (`parse_response(..., rules=)`, `Action.rules`, an evaluation protocol's
`action_rules`)."""


def action_rules(name: str) -> ActionRules:
    try:
        return ACTION_RULES[name]
    except KeyError:
        raise ValueError(f"unknown action rules {name!r}: one of {sorted(ACTION_RULES)}") from None


@dataclass
class Action:
    """One UI-TARS action. Points are (x, y) floats in SCREENSHOT pixels."""

    kind: str
    point: tuple[float, float] | None = None
    end_point: tuple[float, float] | None = None
    text: str | None = None
    """Typed text; finished's content; for `noop`, the name that was not recognised."""
    keys: list[str] = field(default_factory=list)
    direction: str | None = None
    rules: str = "workbench"
    """The ACTION_RULES it was read under and is carried out by (to_pyautogui)."""


@dataclass
class ParsedResponse:
    """A parsed assistant turn."""

    thought: str
    """Text of the Thought (or Reflection/Action_Summary preamble), stripped."""
    actions: list[Action]
    """One or more actions, in order."""
    raw: str
    """The text as received."""


# --------------------------------------------------------------------------- coordinates

def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) the Qwen2/2.5-VL processor resizes an image to.

    Both sides become multiples of ``factor``, the aspect ratio is kept as closely as possible
    and the pixel count is brought into [min_pixels, max_pixels]. Same results as
    transformers' ``qwen2_vl`` ``smart_resize`` (including Python's round-half-even).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got height={height}, width={width}")
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > max_pixels:
        # Shrink both sides by the same scale, rounding down so we stay under the cap.
        scale = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


def _model_space(image_size: tuple[int, int], coord_mode: str, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int, int, int]:
    """(width, height, model_width, model_height): the screenshot and the model's coord space."""
    if coord_mode not in COORD_MODES:
        raise ValueError(f"coord_mode must be one of {COORD_MODES}, got {coord_mode!r}")
    try:
        width, height = (int(v) for v in image_size)
    except (TypeError, ValueError):
        raise ValueError(f"image_size must be (width, height), got {image_size!r}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"image_size must be positive, got {image_size!r}")
    if coord_mode == "qwen2vl":
        return width, height, QWEN2VL_GRID, QWEN2VL_GRID
    model_h, model_w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return width, height, model_w, model_h


# --------------------------------------------------------------------------- scanning

def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _read_quoted(text: str, i: int) -> tuple[str, int]:
    """Read a quoted value starting at text[i] (a quote); return (decoded value, index after).

    The prompt asks for Python string syntax, so a value that is a valid Python string literal
    is read as one (`'caf\\u00e9\\n'` -> "café" + newline), as UI-TARS's own parser does; it is
    parsed with `ast.literal_eval`, which evaluates nothing but literals. Anything else is read
    leniently: only \\n \\t \\' \\" \\\\ are decoded and other backslashes stay as typed. A quote
    of the opening kind closes the value only when followed by optional spaces and ',', ')' or
    the end, so that an unescaped apostrophe in "it's" survives.
    """
    quote = text[i]
    out: list[str] = []
    j = i + 1
    n = len(text)
    while j < n:
        ch = text[j]
        if ch == "\\" and j + 1 < n:
            nxt = text[j + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
            else:
                out.append(ch + nxt)
            j += 2
            continue
        if ch == quote:
            k = _skip_space(text, j + 1)
            if k >= n or text[k] in ",)":
                literal = _python_string(text[i:j + 1])
                return ("".join(out) if literal is None else literal), j + 1
        out.append(ch)
        j += 1
    raise ActionParseError(f"unterminated {quote} quote in action arguments")


def _python_string(quoted: str) -> str | None:
    """`quoted` (quotes included) read as a Python string literal, or None when it is not one."""
    if "\n" in quoted or "\r" in quoted:
        return None  # a raw line break inside a one-line literal: not Python syntax
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes such as "\d" (Python keeps them as typed)
        try:
            value = ast.literal_eval(quoted)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    return value if isinstance(value, str) else None


def _read_bare(text: str, i: int) -> tuple[str, int]:
    """Read an unquoted value up to a ',' or ')' outside brackets; return (value, index)."""
    depth = 0
    j = i
    n = len(text)
    while j < n:
        ch = text[j]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            break
        j += 1
    if j >= n:
        raise ActionParseError("unclosed '(' in action call")
    return text[i:j].strip(), j


def _read_call(text: str, i: int, rules: ActionRules) -> tuple[str, dict[str, str], int]:
    """Read ``name(arg=value, ...)`` at text[i]; return (name, args, index after ')')."""
    m = _IDENT.match(text, i)
    if not m:
        snippet = text[i:i + 30]
        raise ActionParseError(f"expected an action call, found {snippet!r}")
    name = m.group(0)
    if not rules.reads(name):
        raise ActionParseError(f"unknown action {name[:40]!r}")
    j = _skip_space(text, m.end())
    if j >= len(text) or text[j] != "(":
        raise ActionParseError(f"expected '(' after action name {name!r}")
    j = _skip_space(text, j + 1)
    args: dict[str, str] = {}
    while True:
        if j >= len(text):
            raise ActionParseError(f"unclosed '(' in {name}(...)")
        if text[j] == ")":
            return name, args, j + 1
        am = _IDENT.match(text, j)
        k = _skip_space(text, am.end()) if am else j
        if not am or k >= len(text) or text[k] != "=":
            raise ActionParseError(f"{name}: expected 'argument=value', found {text[j:j + 30]!r}")
        arg = am.group(0)
        if arg in args:
            raise ActionParseError(f"{name}: argument {arg!r} given twice")
        k = _skip_space(text, k + 1)
        if k < len(text) and text[k] in "'\"":
            value, k = _read_quoted(text, k)
        else:
            value, k = _read_bare(text, k)
        args[arg] = value
        k = _skip_space(text, k)
        if k < len(text) and text[k] == ",":
            k = _skip_space(text, k + 1)
        elif k < len(text) and text[k] != ")":
            raise ActionParseError(f"{name}: expected ',' or ')' after argument {arg!r}")
        j = k


# --------------------------------------------------------------------------- values

def _parse_box(value: str, what: str, space: tuple[int, int, int, int]) -> tuple[float, float]:
    """Screenshot (x, y) of a point, or of a box's centre, from any UI-TARS box syntax."""
    cleaned = value
    for token in _BOX_TOKENS:
        cleaned = cleaned.replace(token, " ")
    cleaned = cleaned.strip()
    if cleaned[:1] in "([" and cleaned[-1:] in ")]":
        cleaned = cleaned[1:-1]
    parts = [p for p in _SEPARATORS.split(cleaned) if p]
    if len(parts) not in (2, 4) or not all(_NUMBER.fullmatch(p) for p in parts):
        raise ActionParseError(f"{what}: cannot read a point or box from {value[:60]!r}")
    width, height, model_w, model_h = space
    nums = [float(p) for p in parts]
    # Every number is checked, box corners included: a box with a bad corner is bad output.
    for idx, v in enumerate(nums):
        limit = model_w if idx % 2 == 0 else model_h
        if not math.isfinite(v):
            raise ActionParseError(f"{what}: coordinate {v} is not finite")
        if v < 0:
            raise ActionParseError(f"{what}: negative coordinate {v:g}")
        if v > MAX_COORD_FACTOR * limit:
            raise ActionParseError(f"{what}: coordinate {v:g} far outside the 0..{limit} range")
    if len(nums) == 4:
        x, y = (nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2
    else:
        x, y = nums
    return x / model_w * width, y / model_h * height


def split_keys(spec: str) -> list[str]:
    """'ctrl c' / 'Ctrl+Shift+T' -> lowercase key names (aliases mapped, e.g. arrowup -> up)."""
    keys: list[str] = []
    for token in spec.lower().split():
        if token == "+" or "+" not in token:
            parts = [token]
        else:
            # 'ctrl++' means ctrl and plus; other '+' are separators.
            parts = [p for p in token.split("+") if p]
            if token.endswith("++"):
                parts.append("+")
        keys.extend(KEY_ALIASES.get(p, p) for p in parts)
    return keys


def _check_keys(keys: list[str], what: str) -> None:
    if not keys:
        raise ActionParseError(f"{what} needs at least one key")
    for key in keys:
        if key not in VALID_KEYS:
            raise ActionParseError(f"{what}: unknown key {key[:30]!r}")


def _build_action(name: str, args: dict[str, str], space: tuple[int, int, int, int], rules: ActionRules) -> Action:
    """Check a call's arguments against its action and convert them into an Action."""
    if name not in _OUR_NAMES and name not in rules.extra_names:
        # ARPO's converter writes a comment for a name it does not know: a step that does nothing
        return Action("noop", text=name[:40], rules=rules.name)
    spec = _ARG_SPEC[name]
    alias_to_field = {alias: fld for fld, aliases in spec.items() for alias in aliases}
    values: dict[str, str] = {}
    for arg, value in args.items():
        fld = alias_to_field.get(arg)
        if fld is None:
            raise ActionParseError(f"{name} got unexpected argument {arg[:30]!r}")
        if fld in values:
            raise ActionParseError(f"{name}: {fld} given twice (as {arg!r})")
        values[fld] = value
    for fld in _REQUIRED.get(name, ()):
        if fld not in values:
            raise ActionParseError(f"{name} needs {spec[fld][0]}")

    # press(key=) is a one-key hotkey (ours); error_env() ("the environment is broken") becomes
    # OSWorld's FAIL (to_pyautogui) as in ARPO, a kind of its own: the fork answers call_user() with
    # WAIT first, error_env() never.
    action = Action(kind=rules.extra_names.get(name, {"press": "hotkey"}.get(name, name)), rules=rules.name)
    for fld in ("point", "end_point"):
        if fld in values:
            what = f"{name} {spec[fld][0]}"
            setattr(action, fld, _parse_box(values[fld], what, space))
    if "keys" in values:
        action.keys = split_keys(values["keys"])
        # press(key=) maps onto hotkey only for a single key: a combination would change meaning.
        if name in ("press", "keydown", "keyup") and len(action.keys) != 1:
            raise ActionParseError(f"{name} takes one key, got {values['keys'][:30]!r}")
        _check_keys(action.keys, name)
    if "text" in values:
        action.text = values["text"]
    if "direction" in values:
        direction = values["direction"].strip().lower()
        if direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(f"scroll direction must be up/down/left/right, "
                                   f"got {values['direction'][:30]!r}")
        action.direction = direction
    return action


# --------------------------------------------------------------------------- parse

def _split_thought(prefix: str) -> str:
    """The thought from the text before 'Action:' (label removed)."""
    m = re.search(r"Thought[ \t]*:", prefix)
    if m:
        return prefix[m.end():].strip()
    return prefix.strip()


def parse_response(text: str, image_size: tuple[int, int], coord_mode: str = "qwen25vl", *,
                   min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                   factor: int = 28, rules: str = "workbench") -> ParsedResponse:
    """Parse a UI-TARS assistant turn. ``image_size`` is the screenshot's (width, height);
    ``rules`` names the ACTION_RULES (which names are actions; each Action carries the name).

    Raises ActionParseError on any malformed model output (ConverterError where the rules'
    converter raises), ValueError on bad arguments (unknown coord_mode or rules, bad image_size).
    """
    space = _model_space(image_size, coord_mode, factor, min_pixels, max_pixels)
    the_rules = action_rules(rules)
    if not isinstance(text, str):
        raise ActionParseError(f"response must be text, got {type(text).__name__}")
    if len(text) > MAX_RESPONSE_CHARS:
        raise ActionParseError(f"response too long ({len(text)} > {MAX_RESPONSE_CHARS} chars)")
    if "\x00" in text:
        raise ActionParseError("response contains binary data (NUL characters)")
    label = _ACTION_LABEL.search(text)
    if label is None:
        # Tolerate 'Thought: ... Action: ...' on one line.
        pos = text.find("Action:")
        if pos < 0:
            raise ActionParseError("no 'Action:' found")
        start, body_start = pos, pos + len("Action:")
    else:
        start, body_start = label.start(), label.end()
    thought = _split_thought(text[:start])
    body = text[body_start:].strip()
    stripped = True
    while stripped:
        stripped = False
        for token in _TRAILING_TOKENS:
            if body.endswith(token):
                body = body[: -len(token)].rstrip()
                stripped = True
    if not body:
        raise ActionParseError("no action after 'Action:'")

    calls: list[tuple[str, dict[str, str]]] = []
    i = 0
    while True:
        i = _skip_space(body, i)
        if i >= len(body):
            break
        if calls and body[i] == ";":  # tolerate 'a(); b()'
            i = _skip_space(body, i + 1)
        # Some outputs repeat the label before each action.
        label = _REPEATED_LABEL.match(body, i)
        if label:
            i = _skip_space(body, label.end())
        if i >= len(body):
            break
        name, args, i = _read_call(body, i, the_rules)
        calls.append((name, args))
    if not calls:
        raise ActionParseError("no action after 'Action:'")
    # Every call is read (a bad one anywhere is a format failure), then carried out in order as the
    # rules' converter does: it raises on a raising name, and stops at the first final action.
    built = [None if name in the_rules.raising_names else _build_action(name, args, space, the_rules)
             for name, args in calls]
    actions: list[Action] = []
    for (name, _), action in zip(calls, built):
        if action is None:
            raise ConverterError(f"{name}(): the {the_rules.name} rules' converter raises on it")
        if the_rules.final_action_alone and action.kind in FINAL_KINDS:
            return ParsedResponse(thought=thought, actions=[action], raw=text)
        actions.append(action)
    return ParsedResponse(thought=thought, actions=actions, raw=text)


# --------------------------------------------------------------------------- format

def _quote(text: str) -> str:
    """Single-quoted value with exactly the escapes the parser decodes."""
    escaped = (text.replace("\\", "\\\\").replace("'", "\\'")
               .replace("\n", "\\n").replace("\t", "\\t"))
    return f"'{escaped}'"


def _format_point(point: tuple[float, float], space: tuple[int, int, int, int]) -> str:
    width, height, model_w, model_h = space
    x = max(0, round(point[0] / width * model_w))
    y = max(0, round(point[1] / height * model_h))
    return f"'({x},{y})'"


def format_action(action: Action, image_size: tuple[int, int], coord_mode: str = "qwen25vl", *,
                  min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                  factor: int = 28) -> str:
    """UI-TARS text of an action, points rounded to the model's integer grid.

    The inverse of parsing: ``parse_response('Action: ' + format_action(a, ...))`` gives ``a``
    back up to that rounding. Raises ValueError on an incomplete Action.
    """
    space = _model_space(image_size, coord_mode, factor, min_pixels, max_pixels)
    kind = action.kind
    if kind not in ACTION_KINDS:
        raise ValueError(f"unknown action kind {kind!r}")

    def need(value: object, what: str) -> None:
        if value is None:
            raise ValueError(f"{kind} action needs {what}")

    if kind in ("click", "left_double", "right_single", "hover"):
        need(action.point, "point")
        return f"{kind}(start_box={_format_point(action.point, space)})"
    if kind in ("keydown", "keyup"):
        if len(action.keys) != 1:
            raise ValueError(f"{kind} action needs one key")
        return f"{kind}(key={_quote(action.keys[0])})"
    if kind == "noop":  # the call that was not recognised, without its arguments
        if not (action.text and _IDENT.fullmatch(action.text)):
            raise ValueError("noop action needs the name it stands for in text")
        return f"{action.text}()"
    if kind == "drag":
        need(action.point, "point")
        need(action.end_point, "end_point")
        return (f"drag(start_box={_format_point(action.point, space)}, "
                f"end_box={_format_point(action.end_point, space)})")
    if kind == "hotkey":
        if not action.keys:
            raise ValueError("hotkey action needs keys")
        return f"hotkey(key={_quote(' '.join(action.keys))})"
    if kind == "type":
        need(action.text, "text")
        return f"type(content={_quote(action.text)})"
    if kind == "scroll":
        if action.direction not in SCROLL_DIRECTIONS:
            raise ValueError(f"scroll direction must be one of {SCROLL_DIRECTIONS}, "
                             f"got {action.direction!r}")
        box = "" if action.point is None else f"start_box={_format_point(action.point, space)}, "
        return f"scroll({box}direction='{action.direction}')"
    if kind == "finished":
        return "finished()" if action.text is None else f"finished(content={_quote(action.text)})"
    return f"{kind}()"  # wait, call_user, error_env


def format_response(thought: str, actions: list[Action], image_size: tuple[int, int],
                    coord_mode: str = "qwen25vl", *, min_pixels: int = MIN_PIXELS,
                    max_pixels: int = MAX_PIXELS, factor: int = 28) -> str:
    """A whole assistant turn: ``Thought: ...\\nAction: ...`` (actions separated by blank lines)."""
    if not actions:
        raise ValueError("a response needs at least one action")
    body = "\n\n".join(format_action(a, image_size, coord_mode, min_pixels=min_pixels,
                                     max_pixels=max_pixels, factor=factor) for a in actions)
    return f"Thought: {thought}\nAction: {body}"


# --------------------------------------------------------------------------- pyautogui

PYAUTOGUI_FUNCTIONS = frozenset({
    "click", "doubleClick", "rightClick", "moveTo", "dragTo", "mouseDown", "mouseUp",
    "hotkey", "press", "write", "typewrite", "scroll", "keyDown", "keyUp",
})
"""The only pyautogui functions generated code calls (plus time.sleep and pyperclip.copy)."""
GENERATED_CALLS = frozenset({("pyautogui", f) for f in PYAUTOGUI_FUNCTIONS} | {("time", "sleep"), ("pyperclip", "copy")})
"""Every (module, function) generated code may call, always with literal arguments."""
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


def to_pyautogui(action: Action, screen_size: tuple[int, int] = (1920, 1080), *, clipboard: bool = True) -> str:
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
    would be pasted is typed as far as pyautogui can type it.
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
        elif len(keys) == 1:
            lines.append(f"pyautogui.press({keys[0]!r})")
        else:
            lines.append(f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})")
    elif kind == "type":
        lines += _typing(action, clipboard)[0]
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


def _type_lines(text: str, clipboard: bool = True) -> tuple[list[str], str]:
    """Type `text` (ours): if pyautogui can type all of it, pyautogui.write; otherwise (accents,
    CJK, emoji) the whole text through the clipboard and one ctrl+v, as UI-TARS's own code types
    (one paste, not one per run: back-to-back clipboard hand-overs drop characters). A text longer
    than MAX_TYPED_CHARS is pasted too: typed, it would outlast the action's time. A trailing
    newline is an Enter. Without a clipboard, what pyautogui can type of it is typed.
    Returns (the lines, the text left untyped for want of a clipboard)."""
    enter = text.endswith("\n")
    body = text[:-1] if enter else text
    lines, lost = [], ""
    if body and _TYPEABLE.fullmatch(body) and len(body) <= MAX_TYPED_CHARS:
        lines.append(f"pyautogui.write({body!r}, interval={TYPE_INTERVAL!r})")
    elif body and clipboard:
        lines += _paste(body)
    elif body:
        typed, lost = _split_typeable(body)
        if typed:
            lines.append(f"pyautogui.write({typed!r}, interval={TYPE_INTERVAL!r})")
    if enter:
        lines.append("pyautogui.press('enter')")
    return lines, lost


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


def _arpo_type_lines(text: str, clipboard: bool = True) -> tuple[list[str], str]:
    """Type `text` as ARPO's converter does: pyautogui.write at its pace (characters pyautogui has
    no key for are skipped in the VM), its pause, then Enter. A text too long to type at that pace
    within an action's time (MAX_ACTION_SECONDS) is typed as ours types it."""
    rules = ACTION_RULES["arpo"]
    typed = _arpo_typed(text) if text else None
    if typed is None:
        return [], ""
    value, enter = typed
    if len(value) * rules.type_interval + rules.type_pause_s > MAX_ACTION_SECONDS or len(value) > MAX_TYPED_CHARS:
        return _type_lines(value + ("\n" if enter else ""), clipboard)
    lines = [f"pyautogui.write({value!r}, interval={rules.type_interval!r})"] if value else []
    lines.append(f"time.sleep({rules.type_pause_s!r})")
    if enter:
        lines.append("pyautogui.press('enter')")
    return lines, ""


def _typing(action: Action, clipboard: bool) -> tuple[list[str], str]:
    type_lines = _arpo_type_lines if action_rules(action.rules).write_everything else _type_lines
    return type_lines(action.text or "", clipboard)


def lost_without_clipboard(action: Action) -> str | None:
    """The text a type action would leave untyped on a machine without a clipboard tool (pyperclip
    finds neither xclip nor xsel): None when it does not paste at all (ASCII text; ARPO's rules)."""
    if action.kind != "type":
        return None
    return _typing(action, clipboard=False)[1] or None


def _paste(text: str) -> list[str]:
    return [f"pyperclip.copy({text!r})", f"time.sleep({CLIPBOARD_SETTLE_S!r})", "pyautogui.hotkey('ctrl', 'v')",
            f"time.sleep({PASTE_PAUSE_S!r})"]


class UnsafeCodeError(ValueError):
    """Code offered for execution is not what `to_pyautogui` generates (the desktop sandbox's action
    server refuses it)."""


MAX_ACTION_CODE_CHARS = 131_072
"""Code offered for execution is refused above this size (a typed text of MAX_RESPONSE_CHARS
characters, escaped, fits): parsing stays fast, and a body of nested operators cannot exhaust
the parser."""
MAX_ACTION_STATEMENTS = 64
"""Generated code has a few lines per action (at most ~10); more is refused before any is checked."""
MAX_ACTION_SECONDS = 45.0
"""What the declared sleeps, drag durations and typing intervals of one action may add up to (the
action server gives an action 60 s)."""
MAX_TYPED_CHARS = 4_000
"""pyautogui.write types at most this many characters (at TYPE_INTERVAL: 40 s); longer texts are
pasted through the clipboard (`_type_lines`)."""
MAX_CLIPBOARD_CHARS = 4 * MAX_RESPONSE_CHARS
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
