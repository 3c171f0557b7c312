"""The generated pyautogui code, run for real: a private X server (Xvfb), Chromium showing a page
that records what reaches it, and every action kind executed as OSWorld executes it (`python -c`
with the code), then read back from the page. Non-ASCII text included: pyautogui.write alone
would type "café 日本語" as "caf ".

Without a clipboard tool (a PATH with neither xclip nor xsel), the paste fails silently and
loses everything; the code for a machine without one types the ASCII part.

Skipped where Xvfb, xclip, Chromium or pyautogui are missing (`./workbench setup` installs them)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from arpo_lib.actions import Action, to_pyautogui
from arpo_lib.envs.osworld.env import CLIPBOARD_PROBE

pytestmark = pytest.mark.slow
SCREEN = (1024, 768)
PAGE = """<!doctype html><html><body style="margin:0;font:16px sans-serif">
<textarea id="t" style="position:absolute;left:20px;top:20px;width:400px;height:120px"></textarea>
<div id="pad" style="position:absolute;left:20px;top:200px;width:600px;height:300px;background:#def;overflow:scroll">
  <div style="width:3000px;height:3000px"></div></div>
<script>
window.events = [];
const pad = document.getElementById('pad');
for (const kind of ['click', 'dblclick', 'contextmenu', 'mousedown', 'mouseup']) {
  pad.addEventListener(kind, e => { window.events.push({kind, x: e.clientX, y: e.clientY}); if (kind === 'contextmenu') e.preventDefault(); });
}
pad.addEventListener('wheel', e => window.events.push({kind: 'wheel', dx: Math.sign(e.deltaX), dy: Math.sign(e.deltaY)}));
document.addEventListener('keydown', e => { if (e.ctrlKey && e.key !== 'Control') window.events.push({kind: 'key', key: 'ctrl+' + e.key}); });
</script></body></html>"""


def _missing() -> str | None:
    for tool in ("Xvfb", "xclip", "chromium", "chromedriver"):  # xclip: what pyperclip picks first
        if not shutil.which(tool):
            return f"{tool} is not installed (./workbench setup installs it)"
    for module in ("pyautogui", "pyperclip", "Xlib", "selenium"):
        if subprocess.run([sys.executable, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{module}') is None)"]).returncode:
            return f"python package {module} is missing"
    return None


def _start_xvfb() -> tuple[subprocess.Popen, str]:
    """A private X server on the first free display number from 90, once its socket is there."""
    for number in range(90, 190):
        if Path(f"/tmp/.X{number}-lock").exists() or Path(f"/tmp/.X11-unix/X{number}").exists():
            continue
        xvfb = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", f"{SCREEN[0]}x{SCREEN[1]}x24", "-nolisten", "tcp"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while xvfb.poll() is None and time.monotonic() < deadline:
            if Path(f"/tmp/.X11-unix/X{number}").exists():
                return xvfb, f":{number}"
            time.sleep(0.1)
        xvfb.kill()
        xvfb.wait()
    pytest.fail("could not start Xvfb on any display from :90 to :189")


@pytest.fixture(scope="module")
def screen(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    xvfb, display = _start_xvfb()
    env = {**os.environ, "DISPLAY": display, "XDG_SESSION_TYPE": "x11"}
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--no-sandbox", "--disable-gpu", "--window-position=0,0", f"--window-size={SCREEN[0]},{SCREEN[1]}",
                 "--disable-dev-shm-usage", "--no-first-run", f"--user-data-dir={tmp_path_factory.mktemp('chrome')}"):
        options.add_argument(flag)
    chrome_env = {**os.environ, "DISPLAY": display}
    # (Chromium fails to start on Xvfb with XDG_SESSION_TYPE set; pyautogui wants it)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver"), env=chrome_env), options=options)
    try:
        driver.get("data:text/html;charset=utf-8," + quote(PAGE))
        yield driver, env
    finally:
        driver.quit()
        xvfb.terminate()
        xvfb.wait(timeout=10)


def _run(code: str, env: dict[str, str]) -> None:
    """Execute generated code the way OSWorld's VM server does: a fresh `python -c` with stdout and
    stderr piped, waiting for both to close (a paste whose clipboard helper kept them open would
    hang here, as it would hang the VM's /execute)."""
    done = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    time.sleep(0.3)


def _screen_xy(driver, element_id: str, dx: float = 0.5, dy: float = 0.5) -> tuple[float, float]:
    """Screen pixels of a point inside an element (the page's origin on the screen, from the window)."""
    return tuple(driver.execute_script(
        "const r = document.getElementById(arguments[0]).getBoundingClientRect();"
        "const top = window.screenY + window.outerHeight - window.innerHeight;"
        "return [window.screenX + r.left + r.width * arguments[1], top + r.top + r.height * arguments[2]];",
        element_id, dx, dy))


def _events(driver) -> list[dict]:
    out = driver.execute_script("const e = window.events; window.events = []; return JSON.stringify(e);")
    return json.loads(out)


def _act(driver, env, action: Action) -> list[dict]:
    time.sleep(0.6)  # past Chrome's 500 ms double-click time: no action pairs with the one before
    _events(driver)
    _run(to_pyautogui(action, SCREEN), env)
    return _events(driver)


def test_every_action_kind_reaches_a_real_window(screen):
    driver, env = screen
    pad = _screen_xy(driver, "pad", 0.3, 0.3)
    kinds = [e["kind"] for e in _act(driver, env, Action("click", point=pad))]
    assert kinds == ["mousedown", "mouseup", "click"]
    # Elsewhere on the pad: at the same point, within Chrome's double-click time (500 ms on a quiet
    # machine), the single click above and the first of these two made the pair and no dblclick came.
    # Chrome pairs the two clicks by the X server's event times; on a loaded 2-core machine the
    # pair was once not recognised (CI, 1 run in many). Every attempt must deliver exactly two
    # clicks; one of three must be seen as a double click.
    other = _screen_xy(driver, "pad", 0.7, 0.3)
    attempts = []
    for _ in range(3):
        kinds = [e["kind"] for e in _act(driver, env, Action("left_double", point=other))]
        assert kinds.count("click") == 2 and kinds.count("mousedown") == 2, kinds
        attempts.append(kinds)
        if "dblclick" in kinds:
            break
    assert "dblclick" in attempts[-1], attempts
    assert "contextmenu" in [e["kind"] for e in _act(driver, env, Action("right_single", point=pad))]
    end = _screen_xy(driver, "pad", 0.6, 0.7)
    drag = _act(driver, env, Action("drag", point=pad, end_point=end))
    down = next(e for e in drag if e["kind"] == "mousedown")
    up = next(e for e in drag if e["kind"] == "mouseup")
    assert (up["x"] - down["x"], up["y"] - down["y"]) == pytest.approx((end[0] - pad[0], end[1] - pad[1]), abs=2)
    offsets = {}
    for d in ("down", "up", "right", "left"):  # what the user sees: the scroll position moves
        before = driver.execute_script("const p = document.getElementById('pad'); return [p.scrollLeft, p.scrollTop];")
        _act(driver, env, Action("scroll", point=pad, direction=d))
        after = driver.execute_script("const p = document.getElementById('pad'); return [p.scrollLeft, p.scrollTop];")
        offsets[d] = (after[0] - before[0], after[1] - before[1])
    assert offsets["down"][1] > 0 and offsets["up"][1] < 0 and offsets["down"][0] == offsets["up"][0] == 0
    assert offsets["right"][0] > 0 and offsets["left"][0] < 0  # shift + wheel scrolls sideways
    keys = _act(driver, env, Action("hotkey", keys=["ctrl", "b"]))
    assert {"kind": "key", "key": "ctrl+b"} in keys


PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7f))
"""Every printable ASCII character: pyautogui on X11 types `<` as `>` (it presses shift with the
keycode X gives the keysym `less`, the ISO key whose shifted symbol is `>`)."""


@pytest.mark.parametrize("text", ["plain ascii, (punctuation)!\n", "café 日本語 — ünïcödé 😀", "mixed\tä\nline 2",
                                  PRINTABLE_ASCII, "wc -l < in.txt > out.txt && [ 1 -lt 2 ] <<< '<b>'\n"])
def test_typed_text_arrives_whole_non_ascii_included(screen, text):
    driver, env = screen
    driver.execute_script("const t = document.getElementById('t'); t.value = '';")
    _run(to_pyautogui(Action("click", point=_screen_xy(driver, "t")), SCREEN), env)
    # Keystrokes sent before the click has focused the field are lost (a loaded machine: a
    # clean-clone run lost a whole text after a fixed 0.1 s): wait until the page says it is focused.
    deadline = time.monotonic() + 10
    while driver.execute_script("return document.activeElement && document.activeElement.id;") != "t":
        assert time.monotonic() < deadline, "the click did not focus the text field"
        time.sleep(0.05)
    time.sleep(0.1)
    _run(to_pyautogui(Action("type", text=text), SCREEN), env)
    deadline = time.monotonic() + 10  # a paste is read by the page asynchronously: late, not lost
    while (value := driver.execute_script("return document.getElementById('t').value;")) != text \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert value == text


def test_without_a_clipboard_tool_the_ascii_part_and_the_enter_arrive(screen, tmp_path):
    """A PATH with neither xclip nor xsel: the probe says so; the paste exits 1 with nothing on
    stderr (sent to /dev/null) and types nothing, Enter included; the code generated for such a
    machine types the ASCII part and the Enter."""
    driver, env = screen
    bare = {**env, "PATH": str(tmp_path)}  # an empty directory: no clipboard tool
    probe = subprocess.run([sys.executable, "-c", CLIPBOARD_PROBE], env=bare, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "clipboard: False", probe.stderr
    action = Action("type", text="café ok\n")
    value = "return document.getElementById('t').value;"
    driver.execute_script("const t = document.getElementById('t'); t.value = '';")
    _run(to_pyautogui(Action("click", point=_screen_xy(driver, "t")), SCREEN), env)
    time.sleep(0.1)
    blind = subprocess.run([sys.executable, "-c", to_pyautogui(action, SCREEN)], env=bare, capture_output=True,
                           text=True, timeout=60)
    time.sleep(0.3)
    assert (blind.returncode, blind.stderr, driver.execute_script(value)) == (1, "", "")
    _run(to_pyautogui(action, SCREEN, clipboard=False), bare)
    assert driver.execute_script(value) == "caf ok\n"
