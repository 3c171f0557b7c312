"""Model output is untrusted text that drives a computer.

Thousands of generated and adversarial responses go through the parser and the pyautogui
converter. The parser either returns valid actions or raises ActionParseError (nothing else);
the converter's output is Python in which every statement is `import pyautogui` or a whitelisted
pyautogui call whose arguments are literals (an AST walk written here, independently of the
library), with every coordinate inside the screen.
"""
from __future__ import annotations

import ast
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arpo_lib.actions import (
    ACTION_KINDS, DETACH_OUTPUT, GENERATED_CALLS, VALID_KEYS, ActionParseError, parse_response, to_pyautogui,
)

LONG = os.environ.get("ARPO_LONG_TESTS", "") not in ("", "0")
EXAMPLES = 50_000 if LONG else 5_000  # per property; each example tries 1-3 strings

SCREEN = (1920, 1080)
IMAGE = (1920, 1080)
POINT_CALLS = {"click", "doubleClick", "rightClick", "moveTo", "dragTo", "tripleClick", "middleClick"}
SPECIAL = {"WAIT", "DONE", "FAIL"}
counts = {"parsed": 0, "refused": 0, "converted": 0}


def _literal(node: ast.AST) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    raise AssertionError(f"non-literal argument: {ast.dump(node)}")


def check_code(code: str, screen: tuple[int, int]) -> None:
    if code in SPECIAL:
        return
    tree = ast.parse(code)  # must be valid Python
    assert tree.body and isinstance(tree.body[0], ast.Import)
    assert tree.body[0].names[0].name == "pyautogui"
    lines = [ast.unparse(stmt) for stmt in tree.body]
    if "import os" in lines:  # os only for the two fixed lines that detach output, right before the copy
        assert DETACH_OUTPUT[0] in lines
        at = lines.index(DETACH_OUTPUT[0])
        assert len(lines) > at + 2 and lines[at:at + 3] == [*DETACH_OUTPUT, lines[at + 2]] and lines[at + 2].startswith("pyperclip.copy(")
        assert sum("os." in line for line in lines) == 2
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            assert [(a.name, a.asname) for a in stmt.names] in ([("pyautogui", None)], [("time", None)],
                                                                [("pyperclip", None)], [("os", None)])
            continue
        if ast.unparse(stmt) in DETACH_OUTPUT:  # the two fixed lines before a paste, nothing else
            continue
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), ast.unparse(stmt)
        call = stmt.value
        assert isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
        owner, name = call.func.value.id, call.func.attr
        assert (owner, name) in GENERATED_CALLS, name
        args = [_literal(a) for a in call.args]
        kwargs = {k.arg: _literal(k.value) for k in call.keywords}
        assert None not in kwargs
        for value in [*args, *kwargs.values()]:
            if isinstance(value, float):
                assert math.isfinite(value)
        if name in POINT_CALLS and args:
            x, y = args[:2]
            assert isinstance(x, int) and isinstance(y, int) and 0 <= x < screen[0] and 0 <= y < screen[1]
        if name in ("hotkey", "press", "keyDown", "keyUp"):
            assert all(a in VALID_KEYS for a in args), args


def through_the_pipeline(text: str, mode: str = "qwen25vl") -> None:
    try:
        result = parse_response(text, IMAGE, mode)
    except ActionParseError:
        counts["refused"] += 1
        return
    counts["parsed"] += 1
    assert result.actions and all(a.kind in ACTION_KINDS for a in result.actions)
    for action in result.actions:
        try:
            code = to_pyautogui(action, screen_size=SCREEN)
        except ActionParseError:
            continue  # refused at conversion (e.g. a key pyautogui lacks): never executed
        counts["converted"] += 1
        check_code(code, SCREEN)


# Pieces that make a generator hit the parser's corners: every action, box syntax, quoting,
# escapes, code injection, odd numbers, unicode, control characters.
NUMBERS = ["0", "1", "-1", "999", "1000", "1e308", "-1e308", "1e-320", "nan", "NaN", "inf", "-inf", "1e9",
           "99999999999999999999999999", "0x10", "1_000", "٣", "1.", ".5", "+7", "--3", "1e", "12.5e2"]
PIECES = ["click", "left_double", "right_single", "drag", "hotkey", "press", "keydown", "keyup", "type",
          "scroll", "wait", "finished", "call_user", "open", "__import__", "os.system", "eval",
          "(", ")", "'", '"', "'''", ",", "=", "\\", "\\'", "\\n", "\n", " ", "\t", "\r", "\x00",
          "start_box", "end_box", "point", "start_point", "end_point", "content", "key", "direction",
          "<|box_start|>", "<|box_end|>", "<point>", "</point>", "<bbox>", "</bbox>", "[", "]",
          "Action:", "Thought:", "Reflection:", "<|im_end|>", "ctrl", "enter", "up", "f13",
          "'); import os; os.system('id'); ('", "${jndi:ldap://x}", "\u202e", "😀", "中文", "\u2028"]
structured = st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from(NUMBERS), st.text(max_size=6)),
                      max_size=60).map("".join)


def _call(name: str, arg: str) -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(NUMBERS), st.sampled_from(NUMBERS), st.text(max_size=30)).map(
        lambda t: f"Thought: {t[2]}\nAction: {name}({arg}='({t[0]},{t[1]})')")


calls = st.one_of(_call("click", "start_box"), _call("left_double", "point"), _call("scroll", "start_box"),
                  st.tuples(st.sampled_from(NUMBERS), st.sampled_from(NUMBERS), st.sampled_from(NUMBERS),
                            st.sampled_from(NUMBERS)).map(
                      lambda n: f"Action: drag(start_box='<|box_start|>({n[0]},{n[1]})<|box_end|>', "
                                f"end_box='<point>{n[2]} {n[3]}</point>')"),
                  st.text(max_size=200).map(lambda t: "Action: type(content='" + t + "')"),
                  st.text(max_size=40).map(lambda t: "Action: hotkey(key='" + t + "')"))
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH, derandomize=not LONG)
@given(st.text(max_size=500), st.sampled_from(["qwen25vl", "qwen2vl"]))
def test_arbitrary_text(text, mode):
    for candidate in (text, "Action: " + text, "Thought: x\nAction: type(content='" + text + "')"):
        through_the_pipeline(candidate, mode)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH, derandomize=not LONG)
@given(structured, st.sampled_from(["qwen25vl", "qwen2vl"]))
def test_structured_garbage(body, mode):
    through_the_pipeline("Action: " + body, mode)
    through_the_pipeline(body, mode)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH, derandomize=not LONG)
@given(calls, st.sampled_from(["qwen25vl", "qwen2vl"]))
def test_well_formed_calls_with_hostile_arguments(text, mode):
    through_the_pipeline(text, mode)


@pytest.mark.parametrize("code", [
    "import os", "import pyautogui\nimport os",
    "import pyautogui\nimport os\nos.dup2(os.open(os.devnull, os.O_WRONLY), 1)\nos.dup2(os.open(os.devnull, os.O_WRONLY), 2)",
    "import pyautogui\nimport os\nos.system('x')", "import pyautogui\nos.dup2(3, 1)", "import pyautogui\npyautogui.click(__import__('os'), 1)",
    "import pyautogui\npyautogui.click(5000, 1)", "import pyautogui\npyautogui.click(-1, 1)",
    "import pyautogui\nexec('x')", "import pyautogui\npyautogui.write('a'); import os",
    "import pyautogui\nx = 1", "import pyautogui\npyautogui.hotkey('ctrl', 'nosuchkey')",
    "import pyautogui\npyautogui.click(x=1, **k)", "import pyautogui\npyautogui.moveTo(1.5, float('nan'))",
])
def test_the_checker_itself_refuses_unsafe_code(code):
    with pytest.raises((AssertionError, SyntaxError)):
        check_code(code, SCREEN)


def test_one_megabyte_responses_are_refused_quickly():
    for text in ["Action: type(content='" + "a" * 1_000_000 + "')",
                 "Action: click(start_box='(" + "9" * 1_000_000 + ",1)')",
                 "Thought: " + "\\" * 1_000_000, "\n" * 1_000_000, "\u00e9" * 1_000_000]:
        start = time.perf_counter()
        with pytest.raises(ActionParseError):
            parse_response(text, IMAGE)
        assert time.perf_counter() - start < 2.0  # a bound on work, not a benchmark: 1 MB must not go quadratic


def test_record_counts(figures):
    """Runs last in this module: the number of inputs the properties above pushed through."""
    total = counts["parsed"] + counts["refused"]
    assert total >= 3 * EXAMPLES
    figures.update(inputs=total, parsed=counts["parsed"], refused=counts["refused"],
                   converted_actions=counts["converted"], examples_per_property=EXAMPLES)
