"""The UI-TARS action space: action kinds, keys, coordinates, the action rules, and the types
that parsing, formatting and the pyautogui converter share (`Action`, `ParsedResponse`, the errors).

The conventions (coordinate modes, the two action rules) are described in the package docstring,
`arpo_lib.actions`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from desktop_sandbox.action_code import VALID_KEYS

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

KEY_ALIASES = {
    "control": "ctrl", "arrowup": "up", "arrowdown": "down", "arrowleft": "left",
    "arrowright": "right", "page_up": "pageup", "page_down": "pagedown", "pgdown": "pgdn",
    "spacebar": "space", "cmd": "command", "meta": "win", "super": "win", "windows": "win",
    "bksp": "backspace", "ins": "insert", "plus": "+", "minus": "-",
}
"""Spellings models use for keys pyautogui names differently. On OSWorld's Ubuntu the
meta/super key is pyautogui's 'win'."""

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
    docstring of `arpo_lib.actions`, "Action rules"). Everything else (boxes, keys, argument names, quoting) is read
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


# --------------------------------------------------------------------------- keys

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
