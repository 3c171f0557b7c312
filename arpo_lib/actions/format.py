"""Writing actions back as UI-TARS text, in the model's own coordinate convention: the inverse of
parsing (`parse_response(format_response(...))` gives the actions back, up to rounding to the
model's integer grid). The scripted demonstrator writes its responses with it (`agent/scripted.py`).
"""
from __future__ import annotations

from arpo_lib.actions.parse import _IDENT
from arpo_lib.actions.space import ACTION_KINDS, MAX_PIXELS, MIN_PIXELS, SCROLL_DIRECTIONS, Action, _model_space


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
