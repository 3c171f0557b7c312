"""Finding a browser and its driver without snap: stand-in executables for
Ubuntu's snap wrapper, Google Chrome's .deb, Chrome for Testing in Selenium Manager's cache, and
drivers of the wrong version. Nothing here downloads anything."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_lib.envs.miniwob import browser
from arpo_lib.envs.miniwob.browser import BrowserNotFoundError, find_browser

UBUNTU_WRAPPER = """#!/bin/sh
# Ubuntu's transitional package: the real browser is in the snap
echo "Command '/usr/bin/chromium-browser' requires the chromium snap to be installed." >&2
echo "Please install it with: snap install chromium" >&2
exit 1
"""


def _exe(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _prints(path: Path, line: str) -> str:
    return _exe(path, f"#!/bin/sh\necho '{line}'\n")


@pytest.fixture
def system(tmp_path, monkeypatch):
    """An empty PATH of stand-ins, no Google Chrome, an empty Selenium Manager cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("MINIWOB_CHROME_BINARY", raising=False)
    monkeypatch.delenv("MINIWOB_CHROMEDRIVER", raising=False)
    monkeypatch.setenv("SE_CACHE_PATH", str(tmp_path / "selenium"))
    monkeypatch.setattr(browser, "GOOGLE_CHROME", tmp_path / "opt" / "google" / "chrome" / "chrome")
    return tmp_path


def test_debian_chromium_and_its_driver_on_path(system):
    chromium = _prints(system / "bin" / "chromium", "Chromium 156.0.8078.108 built on Debian GNU/Linux 13")
    driver = _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.8078.108 (1a2b3c)")
    found = find_browser()
    assert (found.binary, found.driver, found.version, found.major) == (chromium, driver, "156.0.8078.108", 156)


def test_ubuntus_snap_wrapper_is_turned_down_for_google_chrome_and_a_cached_driver(system):
    """Colab: apt's chromium-browser is the snap wrapper; Google Chrome's .deb is at
    /opt/google/chrome, its driver in Selenium Manager's cache; an old cached driver is skipped."""
    _exe(system / "bin" / "chromium-browser", UBUNTU_WRAPPER)
    chrome = _prints(browser.GOOGLE_CHROME, "Google Chrome 131.0.6778.85")
    _prints(system / "selenium" / "chromedriver" / "linux64" / "130.0.6723.116" / "chromedriver", "ChromeDriver 130.0.6723.116")
    driver = _prints(system / "selenium" / "chromedriver" / "linux64" / "131.0.6778.85" / "chromedriver",
                     "ChromeDriver 131.0.6778.85 (xyz)")
    found = find_browser()
    assert (found.binary, found.driver) == (chrome, driver)
    assert browser.is_snap_wrapper(str(system / "bin" / "chromium-browser"))


def test_chrome_for_testing_from_selenium_managers_cache_alone(system):
    chrome = _prints(system / "selenium" / "chrome" / "linux64" / "131.0.6778.85" / "chrome",
                     "Google Chrome for Testing 131.0.6778.85")
    _prints(system / "selenium" / "chrome" / "linux64" / "129.0.1" / "chrome", "Google Chrome for Testing 129.0.1")
    driver = _prints(system / "selenium" / "chromedriver" / "linux64" / "131.0.6778.85" / "chromedriver",
                     "ChromeDriver 131.0.6778.85")
    assert (find_browser().binary, find_browser().driver) == (chrome, driver)  # the newest Chrome first


def test_nothing_usable_says_what_was_tried_why_and_the_fix(system):
    _exe(system / "bin" / "chromium-browser", UBUNTU_WRAPPER)
    _exe(system / "bin" / "chromedriver", UBUNTU_WRAPPER.replace("chromium-browser", "chromedriver"))
    with pytest.raises(BrowserNotFoundError) as err:
        find_browser()
    text = str(err.value)
    assert "chromium-browser: Ubuntu's wrapper for the snap" in text
    assert "chromedriver: Ubuntu's wrapper for the snap" in text
    assert "google-chrome-stable_current_amd64.deb" in text and "./workbench setup" in text
    assert "MINIWOB_CHROMEDRIVER" in text


def test_a_driver_of_another_version_is_turned_down_by_name(system):
    _prints(system / "bin" / "google-chrome", "Google Chrome 131.0.6778.85")
    _prints(system / "bin" / "chromedriver", "ChromeDriver 120.0.6099.109")
    with pytest.raises(BrowserNotFoundError, match=r"no chromedriver of major version 131 \(found: .*120\.0\.6099\.109"):
        find_browser()


def test_an_explicit_choice_that_does_not_work_is_the_error_not_replaced(system):
    _prints(system / "bin" / "chromium", "Chromium 156.0.1")
    _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.1")
    os.environ["MINIWOB_CHROME_BINARY"] = str(system / "nope")
    try:
        with pytest.raises(BrowserNotFoundError, match=r"nope \(MINIWOB_CHROME_BINARY\): not an executable"):
            find_browser()
    finally:
        del os.environ["MINIWOB_CHROME_BINARY"]
    broken = _exe(system / "bin" / "hangs-up", "#!/bin/sh\necho 'segmentation fault' >&2\nexit 139\n")
    os.environ["MINIWOB_CHROME_BINARY"] = broken
    try:
        with pytest.raises(BrowserNotFoundError, match="exit 139"):
            find_browser()
    finally:
        del os.environ["MINIWOB_CHROME_BINARY"]


def test_fetch_driver_asks_selenium_manager_for_the_browsers_version(system, monkeypatch):
    chrome = _prints(browser.GOOGLE_CHROME, "Google Chrome 131.0.6778.85")
    asked = []

    def binary_paths(self, args):  # what Selenium Manager does: the driver into its cache
        asked.append(args)
        path = _prints(system / "selenium" / "chromedriver" / "linux64" / "131.0.6778.85" / "chromedriver",
                       "ChromeDriver 131.0.6778.85")
        return {"driver_path": path, "browser_path": chrome}

    monkeypatch.setattr("selenium.webdriver.common.selenium_manager.SeleniumManager.binary_paths", binary_paths)
    driver = browser.fetch_driver()
    assert asked == [["--browser", "chrome", "--browser-path", chrome]] and driver.endswith("131.0.6778.85/chromedriver")
    assert browser.fetch_driver() == driver and len(asked) == 1  # a matching one is there: nothing fetched


def test_the_module_prints_exports_for_the_shell(system):
    chromium = _prints(system / "bin" / "chromium", "Chromium 156.0.1")
    driver = _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.1")
    env = {**os.environ, "PATH": str(system / "bin"), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-m", "arpo_lib.envs.miniwob.browser"], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == f"export MINIWOB_CHROME_BINARY='{chromium}' MINIWOB_CHROMEDRIVER='{driver}'"
    (system / "bin" / "chromedriver").unlink()
    out = subprocess.run([sys.executable, "-m", "arpo_lib.envs.miniwob.browser"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout == "" and "Cannot start MiniWoB++" in out.stderr


def test_the_real_browser_here_is_found(chromium_available):
    found = find_browser()
    assert found.major >= 100 and found.version.split(".")[0] == found.driver_version.split(".")[0]


def test_a_version_run_that_a_signal_ended_is_asked_again(system):
    """Debian's chromium is a shell script: a `--version` run killed from outside (a crash, an
    OOM kill, a fault injector) is no verdict on the browser, so it is run again."""
    marker = system / "killed-once"
    chromium = _exe(system / "bin" / "chromium", f"""#!/bin/sh
if [ ! -e {marker} ]; then : > {marker}; kill -9 $$; fi
echo 'Chromium 156.0.8078.108 built on Debian GNU/Linux 12'
""")
    _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.8078.108 (1a2b3c)")
    assert find_browser().binary == chromium and marker.exists()


def test_a_browser_that_never_answers_for_a_signal_says_so(system):
    _exe(system / "bin" / "chromium", "#!/bin/sh\nkill -9 $$\n")
    _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.8078.108")
    with pytest.raises(BrowserNotFoundError, match=r"exit -9, 3 tries"):
        find_browser()


def test_a_failed_version_run_is_not_remembered(system):
    """The answer of a working browser is kept per file; a failure is asked again at the next
    environment, without the file having to change."""
    marker = system / "failed-once"
    _exe(system / "bin" / "chromium", f"""#!/bin/sh
if [ ! -e {marker} ]; then : > {marker}; echo 'not yet' >&2; exit 1; fi
echo 'Chromium 156.0.8078.108 built on Debian GNU/Linux 12'
""")
    _prints(system / "bin" / "chromedriver", "ChromeDriver 156.0.8078.108")
    with pytest.raises(BrowserNotFoundError, match="not yet"):
        find_browser()
    assert find_browser().version == "156.0.8078.108"
