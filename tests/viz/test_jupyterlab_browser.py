"""The viewers as a person sees them: JupyterLab started on loopback, a small
notebook with `viz.show_trajectory` and `viz.show_group` over a recorded run, opened and run in
headless Chromium (the project's own browser and driver). Checked in the page: the screenshot
with the action drawn appears, moving the slider changes it, the group view opens another
member, the replayed member is marked. A screenshot of the page is kept as a test artifact
($ARPO_TEST_ARTIFACTS, default test-artifacts/ in the repository)."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from arpo_lib.viz.draw import DRAG_COLOUR
from tests.viz.test_draw_widgets import STEPS, write_trajectory

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("ARPO_TEST_ARTIFACTS") or REPO / "test-artifacts")


def _recorded_run(root: Path) -> None:
    """A trajectory (traj/) and a run with one group of three at step 0, member 0 replayed."""
    write_trajectory(root / "traj")
    members = []
    for i in range(3):
        rel = Path(f"runs/r/rollouts/step_000000/t/{i}")
        write_trajectory(root / rel, steps=STEPS if i == 1 else STEPS[:2], task_score=1.0 if i == 0 else 0.0,
                         shade=40 * i)
        members.append({"dir": str(rel), "task_score": 1.0 if i == 0 else 0.0, "reward": 1.0 if i == 0 else -0.5,
                        "advantage": 1.2 if i == 0 else -0.6, "replayed": i == 0, "format_ok": True,
                        "num_steps": 2})
    groups = [{"task": "miniwob/test-task", "all_failed": True, "injected": True, "members": members}]
    (root / "runs/r/rollouts/step_000000/groups.json").write_text(json.dumps(groups))
    cells = ["from arpo_lib import viz\nviz.show_trajectory('traj')", "viz.show_group('runs/r')"]
    notebook = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
                           "outputs": [], "source": src} for i, src in enumerate(cells)],
                "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
                "nbformat": 4, "nbformat_minor": 5}
    (root / "viewers.ipynb").write_text(json.dumps(notebook))


def _wait(what: str, check, timeout_s: float = 60.0, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on loopback over a directory holding the recorded run; (url, token, root)."""
    from arpo_lib.serving.launch import free_port

    root = tmp_path / "lab"
    root.mkdir()
    _recorded_run(root)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
                             f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
                             *(["--allow-root"] if os.geteuid() == 0 else [])],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                return True
        except OSError:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            return False

    try:
        _wait("JupyterLab to start", up, timeout_s=90)
        yield url, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def browser(chromium_available):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from arpo_lib.envs.miniwob.env import ensure_chromium

    binary, driver_path = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1700",
                 "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


JS_COUNT_COLOUR = """
const [img, rgb] = arguments;
const c = document.createElement('canvas');
c.width = img.naturalWidth; c.height = img.naturalHeight;
const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
const d = ctx.getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) {
  if (Math.abs(d[i] - rgb[0]) < 30 && Math.abs(d[i + 1] - rgb[1]) < 30 && Math.abs(d[i + 2] - rgb[2]) < 30) n++;
}
return n;"""

JS_KERNEL_IDLE = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
return k ? k.status : null;"""


def test_the_viewers_work_in_jupyterlab_in_a_real_browser(lab, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, token, _ = lab
    browser.get(f"{url}/lab/tree/viewers.ipynb?token={token}")
    _wait("the notebook's kernel", lambda: browser.execute_script(JS_KERNEL_IDLE) == "idle", timeout_s=120)
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")

    def outputs():
        return browser.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")

    # the step viewer: its screenshot (with the action drawn) is an image the browser decoded
    images = _wait("the viewers' images", lambda: [i for i in browser.find_elements(By.CSS_SELECTOR, "img.widget-image")
                                                  if browser.execute_script("return arguments[0].naturalWidth", i) > 0]
                   if len(outputs()) >= 4 else None, timeout_s=120)
    viewer_image = images[0]
    first_src = viewer_image.get_attribute("src")
    text = browser.find_elements(By.CSS_SELECTOR, ".widget-html-content")[0]
    assert "click" in text.text and "open the menu" in text.text
    # moving the slider (keyboard on its handle, as a person would) shows the next frame
    handle = browser.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[0]
    handle.send_keys(Keys.ARROW_RIGHT)
    _wait("the next frame", lambda: viewer_image.get_attribute("src") != first_src)
    _wait("the next frame's text", lambda: "move the slider" in text.text)
    # ... with its action drawn: the drag's arrow, in its colour, in the pixels the browser shows
    drawn = browser.execute_script(JS_COUNT_COLOUR, viewer_image, list(DRAG_COLOUR))
    assert drawn > 100, f"{drawn} pixels of the drag's colour in the displayed frame"
    # the static filmstrip below the widget (what a saved notebook shows) is there too
    assert browser.find_elements(By.CSS_SELECTOR, ".jp-RenderedImage img")
    # the group view: three members, the replayed one marked, "open #1" opens member 1
    page = browser.find_element(By.CSS_SELECTOR, ".jp-Notebook").text
    assert "replayed" in page and page.count("fresh") >= 2
    columns = browser.find_elements(By.XPATH, "//button[starts-with(normalize-space(.), 'open #')]")
    assert [b.text for b in columns] == ["open #0", "open #1", "open #2"]
    replayed_border = browser.execute_script(
        "return getComputedStyle(arguments[0]).borderTopColor",
        columns[0].find_element(By.XPATH, "./ancestor::div[contains(@class,'widget-vbox')][1]//img"))
    assert replayed_border.replace(" ", "") == "rgb(214,39,40)"  # REPLAYED_COLOUR
    assert "rollout #0" in browser.find_element(By.CSS_SELECTOR, ".jp-Notebook").text
    columns[1].click()
    _wait("member 1 in the group's viewer", lambda: "rollout #1" in browser.find_element(By.CSS_SELECTOR,
                                                                                          ".jp-Notebook").text)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "jupyterlab_viewers.png"))
