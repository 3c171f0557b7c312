"""UI-TARS actions: parse model text into typed actions, format them back, convert to pyautogui.

(skeleton: the parser is being written)
"""
from __future__ import annotations

from dataclasses import dataclass, field

ACTION_KINDS = (
    "click", "left_double", "right_single", "drag", "hotkey", "type", "scroll",
    "wait", "finished", "call_user",
)


class ActionParseError(ValueError):
    """The model's text is not a valid UI-TARS response (a format failure, never a crash)."""


@dataclass
class Action:
    """One UI-TARS action. Points are (x, y) floats in SCREENSHOT pixels."""

    kind: str
    point: tuple[float, float] | None = None
    end_point: tuple[float, float] | None = None
    text: str | None = None
    keys: list[str] = field(default_factory=list)
    direction: str | None = None
