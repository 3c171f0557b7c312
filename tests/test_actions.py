"""Tests for arpo_lib.actions: parsing UI-TARS text, formatting it back, pyautogui code."""
from __future__ import annotations

import ast
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arpo_lib.actions import (
    ACTION_KINDS, ACTION_RULES, DETACH_OUTPUT, MAX_PIXELS, MAX_RESPONSE_CHARS, MAX_TYPED_CHARS, MIN_PIXELS,
    PYAUTOGUI_FUNCTIONS, SCROLL_AMOUNT, TERMINAL_PASTE_KEYS, VALID_KEYS, Action, ActionParseError, ConverterError,
    ParsedResponse, check_action_code, format_action, format_response, lost_without_clipboard, parse_response,
    paste_keys_for, pastes, smart_resize, split_keys, to_pyautogui,
)

SCREEN = (1920, 1080)  # (width, height)
RESIZED_W, RESIZED_H = 1932, 1092  # smart_resize of 1080x1920 with ARPO's max_pixels


def parse(text: str, mode: str = "qwen25vl", size: tuple[int, int] = SCREEN) -> ParsedResponse:
    return parse_response(text, size, mode)


def one(text: str, mode: str = "qwen25vl", size: tuple[int, int] = SCREEN) -> Action:
    actions = parse(text, mode, size).actions
    assert len(actions) == 1
    return actions[0]


def screen_x(mx: float, mode: str) -> float:
    return mx / (RESIZED_W if mode == "qwen25vl" else 1000) * SCREEN[0]


def screen_y(my: float, mode: str) -> float:
    return my / (RESIZED_H if mode == "qwen25vl" else 1000) * SCREEN[1]


# --------------------------------------------------------------------------- smart_resize

def test_smart_resize_arpo_screen():
    assert smart_resize(1080, 1920) == (RESIZED_H, RESIZED_W)
    assert (MIN_PIXELS, MAX_PIXELS) == (3136, 2116800)


def test_smart_resize_small_and_large():
    h, w = smart_resize(10, 10)
    assert h % 28 == 0 and w % 28 == 0 and h * w >= MIN_PIXELS
    h, w = smart_resize(4000, 6000)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= MAX_PIXELS


def test_smart_resize_rejects_absurd_aspect_and_empty():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)
    with pytest.raises(ValueError):
        smart_resize(0, 100)


def _reference_smart_resize():
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    return mod.smart_resize


@pytest.mark.parametrize("factor,min_px,max_px", [
    (28, MIN_PIXELS, MAX_PIXELS), (28, 56 * 56, 14 * 14 * 4 * 1280), (14, 100, 10_000),
])
def test_smart_resize_matches_transformers_grid(factor, min_px, max_px):
    ref = _reference_smart_resize()
    sides = [1, 7, 13, 14, 15, 27, 28, 29, 42, 56, 99, 100, 224, 333, 480, 720, 768, 1000,
             1080, 1092, 1200, 1440, 1920, 2160, 2560, 3840, 5000]
    for h in sides:
        for w in sides:
            if max(h, w) / min(h, w) > 200:
                continue
            assert smart_resize(h, w, factor, min_px, max_px) == ref(h, w, factor, min_px, max_px)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8000), st.integers(1, 8000),
       st.sampled_from([(28, MIN_PIXELS, MAX_PIXELS), (28, 3136, 1003520), (14, 784, 200_000)]))
def test_smart_resize_matches_transformers_random(h, w, params):
    ref = _reference_smart_resize()
    factor, min_px, max_px = params
    try:
        expected = ref(h, w, factor, min_px, max_px)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(h, w, factor, min_px, max_px)
        return
    assert smart_resize(h, w, factor, min_px, max_px) == expected


# --------------------------------------------------------------------------- boxes

BOX_SYNTAXES = [
    ("'(100,200)'", (100, 200)),
    ("'( 100 , 200 )'", (100, 200)),
    ('"(100,200)"', (100, 200)),
    ("(100,200)", (100, 200)),  # unquoted
    ("'<|box_start|>(100,200)<|box_end|>'", (100, 200)),
    ("'(80,180,120,220)'", (100, 200)),  # box: centre
    ("'<|box_start|>(80,180,120,220)<|box_end|>'", (100, 200)),
    ("'[80, 180, 120, 220]'", (100, 200)),
    ("'[100, 200]'", (100, 200)),
    ("'<point>100 200</point>'", (100, 200)),
    ("'<point> 100  200 </point>'", (100, 200)),
    ("<point>100 200</point>", (100, 200)),
    ("'<bbox>80 180 120 220</bbox>'", (100, 200)),
    ("'(100.5,200.25)'", (100.5, 200.25)),
    ("'(1e2,2e2)'", (100, 200)),
]


@pytest.mark.parametrize("mode", ["qwen25vl", "qwen2vl"])
@pytest.mark.parametrize("box,model_xy", BOX_SYNTAXES)
def test_box_syntaxes_both_modes(box, model_xy, mode):
    action = one(f"Thought: t\nAction: click(start_box={box})", mode)
    assert action.kind == "click"
    assert action.point == pytest.approx((screen_x(model_xy[0], mode), screen_y(model_xy[1], mode)))


def test_qwen25vl_scaling_exact():
    # The resized image's corner maps to the screenshot's corner.
    a = one(f"Action: click(start_box='({RESIZED_W},{RESIZED_H})')")
    assert a.point == pytest.approx(SCREEN)
    a = one("Action: click(start_box='(966,546)')")
    assert a.point == pytest.approx((960.0, 540.0))


def test_qwen2vl_scaling_exact():
    a = one("Action: click(start_box='(500,500)')", "qwen2vl")
    assert a.point == pytest.approx((960.0, 540.0))
    a = one("Action: click(start_box='(1000,1000)')", "qwen2vl", size=(1280, 720))
    assert a.point == pytest.approx((1280.0, 720.0))


def test_other_screen_size_uses_its_own_resize():
    h, w = smart_resize(800, 1280)
    a = one(f"Action: click(start_box='({w},{h})')", size=(1280, 800))
    assert a.point == pytest.approx((1280.0, 800.0))


def test_resize_parameters_are_used():
    h, w = smart_resize(1080, 1920, 28, MIN_PIXELS, 1003520)
    a = parse_response(f"Action: click(start_box='({w // 2},{h // 2})')", SCREEN,
                       max_pixels=1003520).actions[0]
    assert a.point == pytest.approx((960.0, 540.0))


def test_bad_coord_mode_and_image_size():
    with pytest.raises(ValueError, match="coord_mode"):
        parse_response("Action: wait()", SCREEN, "pixels")
    with pytest.raises(ValueError, match="image_size"):
        parse_response("Action: wait()", (0, 1080))
    with pytest.raises(ValueError, match="coord_mode"):
        format_action(Action("wait"), SCREEN, "qwen3")


# --------------------------------------------------------------------------- every action

@pytest.mark.parametrize("mode", ["qwen25vl", "qwen2vl"])
@pytest.mark.parametrize("name", ["click", "left_double", "right_single"])
@pytest.mark.parametrize("arg", ["start_box", "point", "start_point"])
def test_point_actions(name, arg, mode):
    a = one(f"Action: {name}({arg}='(300,400)')", mode)
    assert a == Action(name, point=(screen_x(300, mode), screen_y(400, mode)))


@pytest.mark.parametrize("mode", ["qwen25vl", "qwen2vl"])
def test_drag(mode):
    a = one("Action: drag(start_box='(10,20)', end_box='(30,40)')", mode)
    assert a.kind == "drag"
    assert a.point == pytest.approx((screen_x(10, mode), screen_y(20, mode)))
    assert a.end_point == pytest.approx((screen_x(30, mode), screen_y(40, mode)))
    b = one("Action: drag(start_point='<point>10 20</point>', end_point='<point>30 40</point>')",
            mode)
    assert b == a


@pytest.mark.parametrize("spec,keys", [
    ("ctrl c", ["ctrl", "c"]), ("Ctrl C", ["ctrl", "c"]), ("ctrl+shift+t", ["ctrl", "shift", "t"]),
    ("  alt   f4 ", ["alt", "f4"]), ("enter", ["enter"]), ("ctrl++", ["ctrl", "+"]),
    ("arrowdown", ["down"]), ("control a", ["ctrl", "a"]), ("super", ["win"]),
    ("ctrl shift =", ["ctrl", "shift", "="]), ("pagedown", ["pagedown"]),
])
def test_hotkey(spec, keys):
    assert one(f"Action: hotkey(key='{spec}')") == Action("hotkey", keys=keys)
    assert split_keys(spec) == keys


def test_press_maps_to_single_key_hotkey():
    assert one("Action: press(key='Enter')") == Action("hotkey", keys=["enter"])
    with pytest.raises(ActionParseError, match="press takes one key"):
        parse("Action: press(key='ctrl c')")


@pytest.mark.parametrize("text", [
    "Action: hotkey(key='ctrl banana')", "Action: hotkey(key='')", "Action: hotkey()",
    "Action: keydown(key='shift')", "Action: keyup(key='shift')",
])
def test_bad_hotkeys(text):
    with pytest.raises(ActionParseError):
        parse(text)


@pytest.mark.parametrize("raw,text", [
    (r"type(content='hello')", "hello"),
    (r"type(content='it\'s \"ok\"\n')", "it's \"ok\"\n"),
    (r'type(content="say \"hi\"")', 'say "hi"'),
    (r"type(content='a (b, c) = d, e)')", "a (b, c) = d, e)"),
    (r"type(content='back\\slash\tTab')", "back\\slash\tTab"),
    (r"type(content='C:\Users\x41')", r"C:\Users\x41"),  # unknown escapes stay as written
    (r"type(content='don't stop')", "don't stop"),  # unescaped apostrophe tolerated
    (r"type(content='')", ""),
    (r"type(content='line1\nline2\n')", "line1\nline2\n"),
    (r"type(content='ünïcödé 中文 😀')", "ünïcödé 中文 😀"),
    (r"type(content='x'  )", "x"),
    ("type(content='real\nnewline')", "real\nnewline"),
    (r"type(content='print(__import__(\'os\').system(\'rm -rf /\'))')",
     "print(__import__('os').system('rm -rf /'))"),
    # A valid Python string literal is read as one (the prompt asks for Python string syntax):
    (r"type(content='caf\u00e9\n')", "café\n"),
    (r"type(content='\x41\N{BULLET}\t')", "A\u2022\t"),
    (r"type(content='C:\dir')", "C:\\dir"),  # an unknown escape stays, as in Python
    (r'type(content="\u65e5\u672c")', "日本"),
])
def test_type_content(raw, text):
    assert one("Action: " + raw) == Action("type", text=text)


@pytest.mark.parametrize("mode", ["qwen25vl", "qwen2vl"])
@pytest.mark.parametrize("direction", ["up", "down", "left", "right"])
def test_scroll(direction, mode):
    a = one(f"Action: scroll(start_box='(100,200)', direction='{direction}')", mode)
    assert a == Action("scroll", point=(screen_x(100, mode), screen_y(200, mode)),
                       direction=direction)
    b = one(f"Action: scroll(point='<point>100 200</point>', direction='{direction.upper()}')",
            mode)
    assert b == a
    assert one(f"Action: scroll(direction='{direction}')") == Action("scroll", direction=direction)


def test_scroll_bad_direction():
    with pytest.raises(ActionParseError, match="direction"):
        parse("Action: scroll(start_box='(1,2)', direction='sideways')")
    with pytest.raises(ActionParseError, match="scroll needs direction"):
        parse("Action: scroll(start_box='(1,2)')")


def test_wait_finished_call_user():
    assert one("Action: wait()") == Action("wait")
    assert one("Action: call_user()") == Action("call_user")
    assert one("Action: finished()") == Action("finished")
    assert one("Action: finished(content='The answer is 42.')") == Action("finished",
                                                                          text="The answer is 42.")
    assert one("Action: finished(content='')") == Action("finished", text="")


# --------------------------------------------------------------------------- response layout

def test_thought_multiline():
    r = parse("Thought: I see the menu.\nIt has (a, b).\n\nAction: click(start_box='(1,2)')")
    assert r.thought == "I see the menu.\nIt has (a, b)."
    assert r.raw.startswith("Thought:")
    assert [a.kind for a in r.actions] == ["click"]


def test_no_thought_and_reflection_preamble():
    assert parse("Action: wait()").thought == ""
    r = parse("Reflection: the click missed.\nAction_Summary: click the OK button.\n"
              "Action: click(start_box='(5,5)')")
    assert "the click missed" in r.thought and "click the OK button" in r.thought
    assert r.actions[0].kind == "click"
    assert parse("Thought: go Action: wait()").thought == "go"  # same line


def test_multiple_actions():
    r = parse("Thought: two steps\nAction: click(start_box='(1,2)')\n\ntype(content='a\\n')\n"
              "hotkey(key='ctrl s')")
    assert [a.kind for a in r.actions] == ["click", "type", "hotkey"]
    r = parse("Action: click(start_box='(1,2)')\nAction: wait()")
    assert [a.kind for a in r.actions] == ["click", "wait"]
    r = parse("Action: click(start_box='(1,2)'); wait()")
    assert [a.kind for a in r.actions] == ["click", "wait"]


def test_trailing_special_tokens_and_spaces():
    assert one("Action: wait()<|im_end|>") == Action("wait")
    assert one("Action:   wait (  )  \n\n") == Action("wait")
    assert one("Action: click( start_box = '(1,2)' , )").kind == "click"  # trailing comma


def test_slightly_outside_image_is_allowed():
    a = one(f"Action: click(start_box='({RESIZED_W + 20},{RESIZED_H + 5})')")
    assert a.point[0] > SCREEN[0] and a.point[1] > SCREEN[1]
    assert to_pyautogui(a) == "import pyautogui\npyautogui.click(1919, 1079)"


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("text,message", [
    ("", "no 'Action:' found"),
    ("Thought: I am thinking", "no 'Action:' found"),
    ("click(start_box='(1,2)')", "no 'Action:' found"),
    ("Action:", "no action after"),
    ("Action:   <|im_end|>", "no action after"),
    ("Action: Action:", "no action after"),
    ("Action: foo(x=1)", "unknown action 'foo'"),
    ("Action: open_app(app_name='x')", "unknown action 'open_app'"),
    ("Action: click()", "click needs start_box"),
    ("Action: left_double(direction='up')", "unexpected argument 'direction'"),
    ("Action: drag(start_box='(1,2)')", "drag needs end_box"),
    ("Action: type()", "type needs content"),
    ("Action: click", "expected '\\(' after action name 'click'"),
    ("Action: click(start_box='(1,2)'", "unclosed"),
    ("Action: click(start_box=(1,2", "unclosed"),
    ("Action: type(content='abc)", "unterminated"),
    ("Action: type(content='abc\\')", "unterminated"),
    ("Action: click('(1,2)')", "argument=value"),
    ("Action: click(start_box='(1,2)', start_box='(3,4)')", "given twice"),
    ("Action: click(start_box='(1,2)', point='(3,4)')", "given twice"),
    ("Action: click(start_box='(1,2)') and then some", "unknown action 'and'"),
    ("Action: click(start_box='(1,2)') !!", "expected an action call"),
    ("Action: click(start_box='(1,2)' x)", "unterminated"),
    ("Action: click(start_box='(-100,0,300,400)')", "negative"),
    ("Action: click(start_box='(0,0,1e9,400)')", "far outside"),
    ("Action: click(start_box='(-1,2)')", "negative"),
    ("Action: click(start_box='(1,-0.5)')", "negative"),
    ("Action: click(start_box='(nan,2)')", "cannot read"),
    ("Action: click(start_box='(inf,2)')", "cannot read"),
    ("Action: click(start_box='(1e999,2)')", "not finite"),
    ("Action: click(start_box='(1e300,2)')", "far outside"),
    ("Action: click(start_box='(" + "9" * 500 + ",2)')", "not finite"),
    ("Action: click(start_box='(30000,2)')", "far outside"),
    ("Action: click(start_box='(1,2,3)')", "cannot read"),
    ("Action: click(start_box='(1,2,3,4,5)')", "cannot read"),
    ("Action: click(start_box='(a,b)')", "cannot read"),
    ("Action: click(start_box='')", "cannot read"),
    ("Action: click(start_box='((1,2))')", "cannot read"),
    ("Action: click(start_box='0x10,2')", "cannot read"),
    ("Action: wait(seconds=5)", "unexpected argument"),
    ("Action: __import__(name='os')", "unknown action"),
    ("Action: wait()\x00", "binary"),
])
def test_errors_have_clear_messages(text, message):
    with pytest.raises(ActionParseError, match=message):
        parse(text)


def test_qwen2vl_range_is_1000_grid():
    one("Action: click(start_box='(9999,10)')", "qwen2vl")  # within 10x: clipped later
    with pytest.raises(ActionParseError, match="far outside"):
        parse("Action: click(start_box='(10001,10)')", "qwen2vl")


def test_non_text_and_too_long():
    with pytest.raises(ActionParseError, match="must be text"):
        parse_response(b"Action: wait()", SCREEN)  # type: ignore[arg-type]
    with pytest.raises(ActionParseError, match="too long"):
        parse("Action: wait()" + " " * MAX_RESPONSE_CHARS)
    with pytest.raises(ActionParseError, match="too long"):
        parse("x" * 100_000)


def test_parse_error_is_a_value_error():
    assert issubclass(ActionParseError, ValueError)


ADVERSARIAL = [
    "Action: click(start_box='" + "(" * 19_000,
    "Action: type(content='" + "' " * 9_000,
    "Action: type(content='" + "'" + " " * 18_000 + "x",
    "Action: click(start_box='" + "1 " * 9_000 + "')",
    "Action: click(start_box=" + "[(" * 9_000,
    "Action: " + "wait()" * 3_000,
    "Action: " + "a" * 19_000,
    "Thought: " + "Thought: " * 2_000 + "Action:" + " " * 100,
    "\n" * 19_000,
    " \t" * 9_000 + "Action",
    "Action: type(content='" + "\\" * 19_000,
    "Action: click(start_box='(" + "1" * 18_000 + ",2)')",
    "Action: click(" + "x=1," * 4_000 + ")",
]


def _fastest_parse_s(text: str, tries: int = 3) -> float:
    """The fastest of `tries` parses of `text`: a guard against catastrophic backtracking (a
    regex gone exponential takes minutes, not one second), not a speed measurement, so a stall
    of the machine during one try (seen once in a loaded CI run: 1.4 s for a 14 ms parse) does
    not count."""
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        try:
            parse(text)
        except ActionParseError:
            pass
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_fast(text):
    assert len(text) <= MAX_RESPONSE_CHARS
    assert _fastest_parse_s(text) < 1.0


def test_one_megabyte_is_rejected_fast():
    for text in ["Action: click(start_box='" + "(" * 1_000_000,
                 "Thought: " + "a" * 1_000_000 + "\nAction: wait()",
                 "\x00\xff" * 500_000]:
        with pytest.raises(ActionParseError):
            parse(text)
        assert _fastest_parse_s(text) < 1.0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_fuzz_only_parse_errors(text):
    for candidate in (text, "Action: " + text, "Thought: x\nAction: click(start_box='" + text):
        try:
            result = parse(candidate)
        except ActionParseError:
            continue
        assert result.actions and all(a.kind in ACTION_KINDS for a in result.actions)


_call_pieces = st.sampled_from([
    "click", "drag", "type", "scroll", "hotkey", "(", ")", "'", '"', ",", "=", "\\", "start_box",
    "content", "<point>", "</point>", "<|box_start|>", "1", "23.5", "-", " ", "\n", "Action:",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_call_pieces, max_size=40).map("".join))
def test_fuzz_structured_only_parse_errors(body):
    try:
        result = parse("Action: " + body)
    except ActionParseError:
        return
    for a in result.actions:
        for p in (a.point, a.end_point):
            assert p is None or (all(math.isfinite(v) and v >= 0 for v in p))
        assert to_pyautogui(a) is not None


# --------------------------------------------------------------------------- format / round trip

def test_format_action_examples():
    assert format_action(Action("click", point=(960.0, 540.0)), SCREEN) == \
        "click(start_box='(966,546)')"
    assert format_action(Action("click", point=(960.0, 540.0)), SCREEN, "qwen2vl") == \
        "click(start_box='(500,500)')"
    assert format_action(Action("drag", point=(0, 0), end_point=(1920, 1080)), SCREEN) == \
        f"drag(start_box='(0,0)', end_box='({RESIZED_W},{RESIZED_H})')"
    assert format_action(Action("hotkey", keys=["ctrl", "c"]), SCREEN) == "hotkey(key='ctrl c')"
    assert format_action(Action("type", text="it's\n"), SCREEN) == "type(content='it\\'s\\n')"
    assert format_action(Action("scroll", direction="up"), SCREEN) == "scroll(direction='up')"
    assert format_action(Action("scroll", point=(960, 540), direction="down"), SCREEN) == \
        "scroll(start_box='(966,546)', direction='down')"
    assert format_action(Action("wait"), SCREEN) == "wait()"
    assert format_action(Action("call_user"), SCREEN) == "call_user()"
    assert format_action(Action("finished"), SCREEN) == "finished()"
    assert format_action(Action("finished", text="done"), SCREEN) == "finished(content='done')"


@pytest.mark.parametrize("action", [
    Action("click"), Action("drag", point=(1, 2)), Action("hotkey"), Action("type"),
    Action("scroll", direction="diagonal"), Action("jump"),
])
def test_format_action_rejects_incomplete(action):
    with pytest.raises(ValueError):
        format_action(action, SCREEN)


def test_format_response():
    actions = [Action("click", point=(960.0, 540.0)), Action("type", text="hi\n")]
    text = format_response("Click then type.", actions, SCREEN)
    assert text == ("Thought: Click then type.\nAction: click(start_box='(966,546)')\n\n"
                    "type(content='hi\\n')")
    parsed = parse(text)
    assert parsed.thought == "Click then type."
    assert parsed.actions == actions
    with pytest.raises(ValueError):
        format_response("t", [], SCREEN)


_texts = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]),
                 max_size=200)


def _points(size: tuple[int, int]):
    return st.tuples(st.floats(0, size[0], allow_nan=False),
                     st.floats(0, size[1], allow_nan=False))


def _actions(size: tuple[int, int]):
    pt = _points(size)
    keys = st.lists(st.sampled_from(sorted(VALID_KEYS)), min_size=1, max_size=4)
    return st.one_of(
        st.builds(Action, st.sampled_from(["click", "left_double", "right_single"]), pt),
        st.builds(lambda p, q: Action("drag", point=p, end_point=q), pt, pt),
        st.builds(lambda k: Action("hotkey", keys=k), keys),
        st.builds(lambda t: Action("type", text=t), _texts),
        st.builds(lambda p, d: Action("scroll", point=p, direction=d), st.none() | pt,
                  st.sampled_from(["up", "down", "left", "right"])),
        st.builds(lambda t: Action("finished", text=t), st.none() | _texts),
        st.just(Action("wait")), st.just(Action("call_user")),
    )


def _assert_close(got: Action, want: Action, size: tuple[int, int], mode: str) -> None:
    # One model-grid step in screenshot pixels, halved: the rounding error of format_action.
    if mode == "qwen25vl":
        rh, rw = smart_resize(size[1], size[0])
    else:
        rh, rw = 1000, 1000
    tol = (size[0] / rw / 2 + 1e-6, size[1] / rh / 2 + 1e-6)
    for g, w in ((got.point, want.point), (got.end_point, want.end_point)):
        assert (g is None) == (w is None)
        if g is not None:
            assert abs(g[0] - w[0]) <= tol[0] and abs(g[1] - w[1]) <= tol[1]
    assert (got.kind, got.text, got.keys, got.direction) == \
        (want.kind, want.text, want.keys, want.direction)


@settings(max_examples=250, deadline=None)
@given(st.data(), st.sampled_from(["qwen25vl", "qwen2vl"]),
       st.sampled_from([(1920, 1080), (1280, 720), (1024, 768), (3840, 2160), (390, 844)]))
def test_round_trip(data, mode, size):
    action = data.draw(_actions(size))
    text = "Thought: t\nAction: " + format_action(action, size, mode)
    got = parse_response(text, size, mode).actions
    assert len(got) == 1
    _assert_close(got[0], action, size, mode)


@settings(max_examples=100, deadline=None)
@given(st.lists(_actions(SCREEN), min_size=1, max_size=4), _texts)
def test_round_trip_response(actions, thought):
    thought = thought.strip()
    if "Action" in thought:  # a thought may not contain the label itself
        return
    parsed = parse(format_response(thought, actions, SCREEN))
    assert parsed.thought == thought
    assert len(parsed.actions) == len(actions)
    for got, want in zip(parsed.actions, actions):
        _assert_close(got, want, SCREEN, "qwen25vl")


# --------------------------------------------------------------------------- pyautogui

def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, int, float)) and not isinstance(node.value, bool)
    return (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float)))


def assert_whitelisted(code: str) -> list[ast.Call]:
    """Every statement is an import of pyautogui/time or a whitelisted call on literals."""
    tree = ast.parse(code)
    calls = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            assert all(a.name in ("pyautogui", "time", "pyperclip", "os") and a.asname is None for a in stmt.names)
            continue
        if ast.unparse(stmt) in DETACH_OUTPUT:
            continue
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), ast.dump(stmt)
        call = stmt.value
        func = call.func
        assert isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        assert (func.value.id == "pyautogui" and func.attr in PYAUTOGUI_FUNCTIONS) or \
            (func.value.id, func.attr) in (("time", "sleep"), ("pyperclip", "copy")), ast.unparse(call)
        assert all(_is_literal(a) for a in call.args), ast.unparse(call)
        assert all(k.arg is not None and _is_literal(k.value) for k in call.keywords)
        calls.append(call)
    return calls


@pytest.mark.parametrize("action,code", [
    (Action("click", point=(960.4, 539.6)), "pyautogui.click(960, 540)"),
    (Action("left_double", point=(10, 20)), "pyautogui.doubleClick(10, 20)"),
    (Action("right_single", point=(10, 20)), "pyautogui.rightClick(10, 20)"),
    (Action("drag", point=(10, 20), end_point=(30, 40)),
     "pyautogui.moveTo(10, 20)\npyautogui.dragTo(30, 40, duration=0.5, button='left')"),
    (Action("hotkey", keys=["ctrl", "c"]), "pyautogui.hotkey('ctrl', 'c')"),
    (Action("hotkey", keys=["Enter"]), "pyautogui.press('enter')"),
    (Action("hotkey", keys=["arrowup"]), "pyautogui.press('up')"),
    (Action("type", text="hello"), "pyautogui.write('hello', interval=0.01)"),
    (Action("type", text="hello\n"),
     "pyautogui.write('hello', interval=0.01)\npyautogui.press('enter')"),
    (Action("type", text="\n"), "pyautogui.press('enter')"),
    (Action("scroll", point=(100, 200), direction="up"),
     f"pyautogui.scroll({SCROLL_AMOUNT}, x=100, y=200)"),
    (Action("scroll", point=(100, 200), direction="down"),
     f"pyautogui.scroll({-SCROLL_AMOUNT}, x=100, y=200)"),
    (Action("scroll", direction="down"), f"pyautogui.scroll({-SCROLL_AMOUNT})"),
    (Action("scroll", point=(1, 2), direction="left"),
     f"pyautogui.keyDown('shift')\npyautogui.scroll({SCROLL_AMOUNT}, x=1, y=2)\n"
     "pyautogui.keyUp('shift')"),
    (Action("scroll", direction="right"),
     f"pyautogui.keyDown('shift')\npyautogui.scroll({-SCROLL_AMOUNT})\npyautogui.keyUp('shift')"),
])
def test_to_pyautogui_examples(action, code):
    out = to_pyautogui(action)
    assert out == "import pyautogui\n" + code
    assert_whitelisted(out)


def test_special_strings():
    assert to_pyautogui(Action("wait")) == "WAIT"
    assert to_pyautogui(Action("finished", text="x")) == "DONE"
    assert to_pyautogui(Action("call_user")) == "FAIL"


def test_clipping_to_screen():
    assert to_pyautogui(Action("click", point=(5000.0, -3.0))) == \
        "import pyautogui\npyautogui.click(1919, 0)"
    assert to_pyautogui(Action("click", point=(2000.0, 900.0)), screen_size=(1280, 720)) == \
        "import pyautogui\npyautogui.click(1279, 719)"


def test_to_pyautogui_rejects_bad_actions():
    for action in [Action("click"), Action("click", point=(math.nan, 1.0)),
                   Action("hotkey", keys=["ctrl", "nope"]), Action("hotkey", keys=[]),
                   Action("hotkey", keys=["ctrl'); import os; os.system('x"]),
                   Action("scroll", direction="sideways"), Action("drag", point=(1, 2)),
                   Action("explode")]:
        with pytest.raises(ActionParseError):
            to_pyautogui(action)


INJECTIONS = [
    "'); import os; os.system('rm -rf /'); ('",
    '"); __import__("os").system("id"); ("',
    "\\'); print(1) #",
    "\\",
    "x\\",
    "'''\"\"\"",
    "\n\nimport os\n",
    "a\rb\x0bc\x0cd",
    "\u2028\u2029 line separators",
    "{0.__class__}",
    "中文 😀 \t tab",
]


@pytest.mark.parametrize("text", INJECTIONS)
def test_typed_text_cannot_escape(text):
    code = to_pyautogui(Action("type", text=text))
    calls = assert_whitelisted(code)
    typed = "".join(c.args[0].value for c in calls if c.func.attr in ("write", "copy"))  # typed or pasted, in order
    enter = any(c.func.attr == "press" for c in calls)
    assert typed + ("\n" if enter else "") == text


def test_parsed_injection_end_to_end():
    raw = r"Action: type(content='\'); import os; os.system(\'echo pwned\')  #\n')"
    action = one(raw)
    assert action.text == "'); import os; os.system('echo pwned')  #\n"
    assert_whitelisted(to_pyautogui(action))


@settings(max_examples=250, deadline=None)
@given(_actions((3000, 2000)), st.sampled_from([(1920, 1080), (1280, 720)]))
def test_pyautogui_whitelist_property(action, screen):
    code = to_pyautogui(action, screen_size=screen)
    if action.kind in ("wait", "finished", "call_user"):
        assert code in ("WAIT", "DONE", "FAIL")
        return
    calls = assert_whitelisted(code)
    for call in calls:
        if call.func.attr in ("click", "doubleClick", "rightClick", "moveTo", "dragTo"):
            x, y = (a.value for a in call.args[:2])
            assert 0 <= x < screen[0] and 0 <= y < screen[1]
        for kw in call.keywords:
            if kw.arg == "x":
                assert 0 <= kw.value.value < screen[0]
            if kw.arg == "y":
                assert 0 <= kw.value.value < screen[1]
        if call.func.attr in ("hotkey", "press", "keyDown", "keyUp"):
            assert all(a.value in VALID_KEYS for a in call.args)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_pyautogui_from_fuzzed_type_content(text):
    # Whatever the model types, the parsed action becomes whitelisted code.
    raw = "Action: type(content='" + text.replace("\x00", "") + "')"
    try:
        actions = parse(raw).actions
    except ActionParseError:
        return
    for a in actions:
        code = to_pyautogui(a)
        if code not in ("WAIT", "DONE", "FAIL"):
            assert_whitelisted(code)


def test_ascii_text_is_typed_with_write_alone():
    """ASCII only: pyautogui.write alone, no clipboard, no os (at our pace; ARPO's converter types
    at 0.1 s a character and waits 0.5 s: its rules, below)."""
    code = to_pyautogui(Action("type", text="hello, world\n"))
    assert "pyperclip" not in code and "import os" not in code
    assert code.splitlines()[1:] == ["pyautogui.write('hello, world', interval=0.01)", "pyautogui.press('enter')"]


def test_a_less_than_sign_is_pressed_as_shift_comma_never_written():
    """pyautogui on X11 types `<` as `>` (`wc -l < f` ran `wc -l > f`): every `<` of typed text
    and a pressed `<` become shift+comma, the VM's US layout, as desktop_env rewrites `typewrite`
    (which it never does for `write`); the text between is written as before. The code typed on a
    real screen: tests/test_actions_on_a_screen.py."""
    code = to_pyautogui(Action("type", text="<a<<b<\n"))
    assert code.splitlines()[1:] == [
        "pyautogui.hotkey('shift', ',')", "pyautogui.write('a', interval=0.01)", "pyautogui.hotkey('shift', ',')",
        "pyautogui.hotkey('shift', ',')", "pyautogui.write('b', interval=0.01)", "pyautogui.hotkey('shift', ',')",
        "pyautogui.press('enter')"]
    assert_whitelisted(code)
    assert to_pyautogui(Action("hotkey", keys=["<"])).splitlines()[1:] == ["pyautogui.hotkey('shift', ',')"]
    without = to_pyautogui(Action("type", text="é<b"), clipboard=False)
    assert "<" not in without and without.splitlines()[1:] == ["pyautogui.hotkey('shift', ',')",
                                                               "pyautogui.write('b', interval=0.01)"]
    # ARPO's rules keep what ARPO's converter sends: on the VM its `<` arrives as `>`
    assert "pyautogui.write('a<b', interval=0.1)" in to_pyautogui(Action("type", text="a<b", rules="arpo"))


def test_non_ascii_text_is_pasted_after_detaching_output():
    """Text pyautogui cannot type is pasted whole, once; output is detached once, before the copy
    (see DETACH_OUTPUT: without it the VM server hangs on xclip); enter is still a key press."""
    code = to_pyautogui(Action("type", text="ab é cd 日本\n"))
    lines = code.splitlines()
    assert lines[:4] == ["import pyautogui", "import os", "import pyperclip", "import time"]
    assert lines[4:] == [*DETACH_OUTPUT, "pyperclip.copy('ab é cd 日本')", "time.sleep(0.3)", "pyautogui.hotkey('ctrl', 'v')",
                         "time.sleep(0.2)", "pyautogui.press('enter')"]
    assert_whitelisted(code)


@pytest.mark.parametrize("wm_class,keys", [
    ("gnome-terminal-server.Gnome-terminal", ("ctrl", "shift", "v")),
    ("st-256color.st-256color", ("ctrl", "shift", "v")),
    ("org.gnome.Console.Kgx", ("ctrl", "shift", "v")),
    ("mousepad.Mousepad", ("ctrl", "v")),
    ("libreoffice.libreoffice-writer", ("ctrl", "v")),
    ("google-chrome.Google-chrome", ("ctrl", "v")),
    ("", ("ctrl", "v")),
    (None, ("ctrl", "v")),
])
def test_the_paste_keys_follow_the_focused_window(wm_class, keys):
    assert paste_keys_for(wm_class) == keys


def test_a_terminals_paste_is_generated_where_the_focus_is_a_terminal():
    """The same text, pasted into a terminal, is ctrl+shift+v (its ctrl+v is the shell's
    quoted-insert); only text that is pasted says so (`pastes`)."""
    action = Action("type", text="ls é\n")
    code = to_pyautogui(action, paste_keys=TERMINAL_PASTE_KEYS)
    assert "pyautogui.hotkey('ctrl', 'shift', 'v')" in code and "'ctrl', 'v')" not in code
    assert code.replace("'ctrl', 'shift', 'v'", "'ctrl', 'v'") == to_pyautogui(action)
    assert_whitelisted(code)
    assert pastes(action) and not pastes(Action("type", text="ls <b\n")) and not pastes(Action("hotkey", keys=["a"]))
    assert pastes(Action("type", text="x" * (MAX_TYPED_CHARS + 1)))  # too long to type: pasted


# --------------------------------------------------------------------------- action rules

@pytest.mark.parametrize("text,kind", [
    ("Action: hover(start_box='(966,546)')", "hover"),
    ("Action: left_single(start_box='(966,546)')", "click"),
    ("Action: select(start_box='(10,10)', end_box='(20,20)')", "drag"),
    ("Action: keydown(key='shift')", "keydown"),
    ("Action: keyup(key='Shift')", "keyup"),
    ("Action: open_app(app_name='Chrome')", "noop"),
    ("Action: release(key='shift')", "noop"),  # UI-TARS's newer parser knows it; ARPO's does not
])
def test_names_arpos_converter_knows_are_actions_under_its_rules_only(text, kind):
    with pytest.raises(ActionParseError, match="unknown action"):
        parse(text)
    (action,) = parse_response(text, SCREEN, rules="arpo").actions
    assert (action.kind, action.rules) == (kind, "arpo")


def test_press_is_a_one_key_hotkey_here_and_makes_arpos_converter_raise():
    assert one("Action: press(key='enter')") == Action("hotkey", keys=["enter"])
    with pytest.raises(ConverterError, match="press"):
        parse_response("Action: press(key='enter')", SCREEN, rules="arpo")
    assert issubclass(ConverterError, ActionParseError)  # a format failure wherever it is not caught apart


def test_error_env_is_fail_but_not_call_user():
    assert one("Action: error_env()") == Action("error_env")
    assert to_pyautogui(Action("error_env")) == to_pyautogui(Action("call_user")) == "FAIL"


def test_arpos_rules_run_the_first_final_action_alone():
    text = "Action: click(start_box='(966,546)')\n\nfinished(content='')\n\nwait()"
    assert [a.kind for a in parse(text).actions] == ["click", "finished", "wait"]
    assert [a.kind for a in parse_response(text, SCREEN, rules="arpo").actions] == ["finished"]
    # every call is still read first: a bad one anywhere is a format failure
    with pytest.raises(ActionParseError):
        parse_response("Action: finished()\n\nclick(start_box='(-1,2)')", SCREEN, rules="arpo")
    # the converter stops at the first final action, before a press further on
    assert [a.kind for a in parse_response("Action: wait()\n\npress(key='a')", SCREEN, rules="arpo").actions] == ["wait"]


@pytest.mark.parametrize("action,ours,arpos", [
    (Action("type", text="hello\n"),
     ["pyautogui.write('hello', interval=0.01)", "pyautogui.press('enter')"],
     ["import time", "pyautogui.write('hello', interval=0.1)", "time.sleep(0.5)", "pyautogui.press('enter')"]),
    (Action("drag", point=(10, 20), end_point=(30, 40)),
     ["pyautogui.moveTo(10, 20)", "pyautogui.dragTo(30, 40, duration=0.5, button='left')"],
     ["pyautogui.moveTo(10, 20)", "pyautogui.dragTo(30, 40, duration=1.0, button='left')"]),
    (Action("scroll", point=(1, 2), direction="left"),
     ["pyautogui.keyDown('shift')", f"pyautogui.scroll({SCROLL_AMOUNT}, x=1, y=2)", "pyautogui.keyUp('shift')"], []),
    (Action("scroll", direction="right"),
     ["pyautogui.keyDown('shift')", f"pyautogui.scroll({-SCROLL_AMOUNT})", "pyautogui.keyUp('shift')"], []),
    (Action("scroll", point=(1, 2), direction="down"),
     [f"pyautogui.scroll({-SCROLL_AMOUNT}, x=1, y=2)"], [f"pyautogui.scroll({-SCROLL_AMOUNT}, x=1, y=2)"]),
    (Action("hover", point=(5, 6)), None, ["pyautogui.moveTo(5, 6)"]),
    (Action("keydown", keys=["shift"]), None, ["pyautogui.keyDown('shift')"]),
    (Action("keyup", keys=["ctrl"]), None, ["pyautogui.keyUp('ctrl')"]),
    (Action("noop", text="open_app"), None, []),
])
def test_generated_code_under_each_rules(action, ours, arpos):
    """Ours: typing at 0.01 s a character without a pause, drag 0.5 s, sideways scroll as shift +
    wheel. ARPO's converter: 0.1 s and 0.5 s, 1.0 s, nothing."""
    if ours is not None:
        code = to_pyautogui(action)
        assert code.splitlines() == ["import pyautogui", *ours]
        check_action_code(code, SCREEN)
    arpo = Action(**{**action.__dict__, "rules": "arpo"})
    code = to_pyautogui(arpo)
    assert code.splitlines() == ["import pyautogui", *arpos]
    assert_whitelisted(code)
    check_action_code(code, SCREEN)  # the desktop sandbox's action server accepts it


@pytest.mark.parametrize("text,lines", [
    ("it's\n", ["pyautogui.write(\"it's\", interval=0.1)", "time.sleep(0.5)", "pyautogui.press('enter')"]),
    ("café 日本", ["pyautogui.write('café 日本', interval=0.1)", "time.sleep(0.5)"]),  # pyautogui skips é, 日本 in the VM
    ("a\tb", ["pyautogui.write('a\\tb', interval=0.1)", "time.sleep(0.5)"]),
    ("line 1\nline 2\n", []),  # a line break inside: ARPO's code does not compile, nothing runs
    ("a\rb", []),
    ("C:\\Users\\me", []),  # '\\U' in ARPO's literal: a SyntaxError
    ("x\\y", ["pyautogui.write('x\\\\y', interval=0.1)", "time.sleep(0.5)"]),  # an unknown escape stays
    ("golden\\n", ["pyautogui.write('golde', interval=0.1)", "time.sleep(0.5)", "pyautogui.press('enter')"]),
    ("\n", ["time.sleep(0.5)", "pyautogui.press('enter')"]),
    ("", []),
])
def test_arpos_typing_is_what_its_generated_literal_types(text, lines):
    """ARPO's converter puts the text between single quotes as it is (only bare quotes escaped),
    so Python reads escapes in it and a line break breaks the code; read here without running it."""
    code = to_pyautogui(Action("type", text=text, rules="arpo"))
    assert [x for x in code.splitlines() if not x.startswith("import ")] == lines


def test_arpos_pace_is_kept_only_where_it_fits_in_an_action():
    short, long = "a" * 400, "a" * 600  # 0.1 s a character: 40 s and 60 s (an action gets 45)
    assert "interval=0.1" in to_pyautogui(Action("type", text=short, rules="arpo"))
    code = to_pyautogui(Action("type", text=long, rules="arpo"))
    assert "interval=0.01" in code and "time.sleep" not in code
    check_action_code(code, SCREEN)


def test_typing_without_a_clipboard_types_what_pyautogui_can():
    """Where the machine has no xclip/xsel, a paste would fail and lose everything: the ASCII part
    is typed instead, the Enter kept, and what is lost is known."""
    action = Action("type", text="café 日本 ok\n")
    assert lost_without_clipboard(action) == "é日本"
    code = to_pyautogui(action, clipboard=False)
    assert code.splitlines() == ["import pyautogui", "pyautogui.write('caf  ok', interval=0.01)", "pyautogui.press('enter')"]
    assert "pyperclip" in to_pyautogui(action)
    assert lost_without_clipboard(Action("type", text="plain ascii\n")) is None
    assert lost_without_clipboard(Action("type", text="café", rules="arpo")) is None  # ARPO's never pastes
    assert lost_without_clipboard(Action("click", point=(1, 2))) is None
    assert to_pyautogui(Action("type", text="日本"), clipboard=False) == "import pyautogui"
    assert lost_without_clipboard(Action("type", text="a" * 4005)) == "a" * 5  # too long to type: pasted


def test_new_kinds_format_and_parse_back():
    for action in (Action("hover", point=(960.0, 540.0)), Action("keydown", keys=["shift"]),
                   Action("keyup", keys=["shift"]), Action("noop", text="open_app"), Action("error_env")):
        (back,) = parse_response("Action: " + format_action(action, SCREEN), SCREEN, rules="arpo").actions
        assert back.kind == action.kind and back.keys == action.keys
    assert set(ACTION_RULES) == {"workbench", "arpo"}
    with pytest.raises(ValueError, match="unknown action rules"):
        to_pyautogui(Action("wait", rules="nope"))
