"""Parsing a UI-TARS assistant turn into typed actions: `parse_response`.

A small hand-written scanner reads the model's text (never `eval`, no regex that can backtrack
catastrophically); every argument is checked against its action, every coordinate against the
model's coordinate space. What counts as valid format (the lenient choices) and how the two
action rules read a response: the package docstring, `arpo_lib.actions`.
"""
from __future__ import annotations

import ast
import math
import re
import warnings

from arpo_lib.actions.space import (
    FINAL_KINDS, MAX_COORD_FACTOR, MAX_PIXELS, MAX_RESPONSE_CHARS, MIN_PIXELS, SCROLL_DIRECTIONS, _OUR_NAMES, Action,
    ActionParseError, ActionRules, ConverterError, ParsedResponse, _check_keys, _model_space, action_rules,
    split_keys,
)

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
