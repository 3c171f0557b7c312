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

The package, one module per job (every name below is importable from `arpo_lib.actions`):

- `space`: the action space: kinds, keys, coordinate modes (`smart_resize`), the action rules,
  `Action` / `ParsedResponse` and the errors;
- `parse`: model text -> actions (`parse_response`);
- `format`: actions -> model text (`format_action`, `format_response`);
- `pyautogui`: an action -> OSWorld's code (`to_pyautogui`, `lost_without_clipboard`; the keys
  that paste in the focused window: `pastes`, `paste_keys_for`);
- the safety check lives with the sandbox that enforces it: `desktop_sandbox.action_code`
  (`check_action_code`, the calls, keys and bounds the converter generates within); its names are
  re-exported here.
"""
from __future__ import annotations

from arpo_lib.actions.format import format_action, format_response
from arpo_lib.actions.parse import parse_response
from arpo_lib.actions.pyautogui import (
    CLIPBOARD_SETTLE_S, PASTE_KEYS, PASTE_PAUSE_S, SPECIAL_ACTIONS, TERMINAL_PASTE_KEYS, lost_without_clipboard,
    paste_keys_for, pastes, to_pyautogui,
)
from desktop_sandbox.action_code import (
    DETACH_OUTPUT, GENERATED_CALLS, MAX_ACTION_SECONDS, MAX_TYPED_CHARS, PYAUTOGUI_FUNCTIONS, MAX_ACTION_CODE_CHARS, MAX_ACTION_STATEMENTS, MAX_CLIPBOARD_CHARS, MAX_KEYS_PER_HOTKEY, MAX_REPEAT,
    MAX_SCROLL_CLICKS, UnsafeCodeError, check_action_code,
)
from arpo_lib.actions.space import (
    ACTION_KINDS, ACTION_RULES, COORD_MODES, DRAG_DURATION, FINAL_KINDS, KEY_ALIASES, MAX_COORD_FACTOR, MAX_PIXELS,
    MAX_RESPONSE_CHARS, MIN_PIXELS, QWEN2VL_GRID, SCROLL_AMOUNT, SCROLL_DIRECTIONS, TYPE_INTERVAL, VALID_KEYS, Action,
    ActionParseError, ActionRules, ConverterError, ParsedResponse, action_rules, smart_resize, split_keys,
)

__all__ = [
    "ACTION_KINDS", "ACTION_RULES", "CLIPBOARD_SETTLE_S", "COORD_MODES", "DETACH_OUTPUT", "DRAG_DURATION",
    "FINAL_KINDS", "GENERATED_CALLS", "KEY_ALIASES", "MAX_ACTION_CODE_CHARS", "MAX_ACTION_SECONDS",
    "MAX_ACTION_STATEMENTS", "MAX_CLIPBOARD_CHARS", "MAX_COORD_FACTOR", "MAX_KEYS_PER_HOTKEY", "MAX_PIXELS",
    "MAX_REPEAT", "MAX_RESPONSE_CHARS", "MAX_SCROLL_CLICKS", "MAX_TYPED_CHARS", "MIN_PIXELS", "PASTE_KEYS", "PASTE_PAUSE_S",
    "PYAUTOGUI_FUNCTIONS", "QWEN2VL_GRID", "SCROLL_AMOUNT", "SCROLL_DIRECTIONS", "SPECIAL_ACTIONS", "TERMINAL_PASTE_KEYS",
    "TYPE_INTERVAL",
    "VALID_KEYS", "Action", "ActionParseError", "ActionRules", "ConverterError", "ParsedResponse", "UnsafeCodeError",
    "action_rules", "check_action_code", "format_action", "format_response", "lost_without_clipboard",
    "parse_response", "paste_keys_for", "pastes", "smart_resize", "split_keys", "to_pyautogui",
]
