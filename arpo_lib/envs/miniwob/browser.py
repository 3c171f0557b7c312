"""Finding a Chrome and a matching chromedriver for MiniWoB++ (and Selenium in general), on
Debian, on Ubuntu (Colab) and wherever Selenium Manager put Chrome for Testing.

Where each comes from, in order (the first that works wins):
1. `MINIWOB_CHROME_BINARY` / `MINIWOB_CHROMEDRIVER`: an explicit choice; if it does not work,
   that is the error (never silently replaced).
2. `PATH`: `chromium`, `chromium-browser`, `google-chrome`, `google-chrome-stable` and `chromedriver`.
3. Google Chrome's .deb (`/opt/google/chrome/chrome`), and Selenium Manager's cache
   (`~/.cache/selenium/chrome/<platform>/<version>/chrome`, `.../chromedriver/...`), where
   `./workbench setup` puts the driver that matches Google Chrome on Ubuntu.

A candidate is rejected when it is not an executable, when it is Ubuntu's transitional wrapper
for the snap (apt's `chromium-browser` and `chromium-chromedriver` there: snaps cannot run in a
container such as Colab's), or when `--version` does not answer with a version. The driver must
have the browser's major version (chromedriver refuses other browsers anyway, later and less
clearly). When nothing works, `BrowserNotFoundError` says what was tried, why each was turned
down, and the fix for this system.

`python -m arpo_lib.envs.miniwob.browser` prints the pair found as shell `export` lines (nothing, and
the reason on stderr, when none): `./workbench` runs it before every command. With
`--fetch-driver` it first asks Selenium Manager for the chromedriver of the installed Chrome when
none matches (Chrome for Testing's, into Selenium Manager's cache: needs the internet).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVER_NAMES = ("chromedriver",)
GOOGLE_CHROME = Path("/opt/google/chrome/chrome")
CHROME_DEB_URL = "https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb"

FIX = (
    "Fix: `./workbench setup` installs them: Debian's `chromium chromium-driver` with apt; on Ubuntu "
    "(Colab), where apt's chromium is only a wrapper for a snap that cannot run in a container, "
    f"Google Chrome's .deb ({CHROME_DEB_URL}) and the matching chromedriver through Selenium Manager. "
    "Or point MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER at a Chrome and a chromedriver of the same "
    "major version."
)


class BrowserNotFoundError(RuntimeError):
    """Chromium or chromedriver is missing: an installation problem, so not an `EnvError`
    (restarting the environment would not help)."""


@dataclass(frozen=True)
class Browser:
    binary: str
    driver: str
    version: str
    driver_version: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def selenium_cache() -> Path:
    return Path(os.environ.get("SE_CACHE_PATH") or Path.home() / ".cache" / "selenium")


def _cached(kind: str, name: str) -> list[str]:
    """Selenium Manager's downloads of `kind` (chrome, chromedriver), newest version first."""
    found = [p for p in selenium_cache().glob(f"{kind}/*/*/{name}") if p.is_file()]
    return [str(p) for p in sorted(found, key=lambda p: _version_key(p.parent.name), reverse=True)]


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:4])


def is_snap_wrapper(path: str) -> bool:
    """Ubuntu's transitional `chromium-browser`/`chromedriver`: a shell script that only says the
    snap is needed, or a link into /snap."""
    real = os.path.realpath(path)
    if real.startswith("/snap/") or real == "/usr/bin/snap":
        return True
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"snap" in head


def version_of(path: str, timeout_s: float = 20.0, attempts: int = 3) -> str:
    """The version `path --version` answers (e.g. `156.0.8078.108`); raises ValueError why not.

    A run that a signal ended (a killed process, not an answer) is tried again, `attempts` in all:
    Debian's `chromium` is a shell script, and a crash or an outside kill of it says nothing about
    the browser."""
    for attempt in range(attempts):
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"`--version` failed: {exc}") from exc
        if out.returncode >= 0:
            break
    text = (out.stdout + out.stderr).strip()
    match = re.search(r"\b(\d+\.\d+(?:\.\d+)*)\b", text)
    if out.returncode != 0 or not match:
        tries = f", {attempts} tries" if out.returncode < 0 else ""
        raise ValueError(f"`--version` answered {text[:160]!r} (exit {out.returncode}{tries})")
    return match.group(1)


def _check(path: str) -> tuple[str | None, str]:
    """(version, '') for a usable executable, else (None, why not). Every MiniWoB environment
    asks (`ensure_chromium`), so a working file's version is remembered per file and modification
    time; a failure is asked again next time."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return None, "not an executable file"
    if is_snap_wrapper(path):
        return None, "Ubuntu's wrapper for the snap, which cannot run here"
    stat = os.stat(path)
    try:
        return _version_cached(path, stat.st_mtime_ns, stat.st_size), ""
    except ValueError as exc:
        return None, str(exc)


@functools.lru_cache(maxsize=64)
def _version_cached(path: str, mtime_ns: int, size: int) -> str:
    return version_of(path)  # lru_cache keeps no result for a call that raised


def _candidates(var: str, names: tuple[str, ...], extra: list[str]) -> tuple[list[str], bool]:
    """Paths to try, and whether they come from the environment variable (then only it)."""
    if os.environ.get(var):
        return [os.environ[var]], True
    seen: list[str] = []
    for path in [*filter(None, map(shutil.which, names)), *extra]:
        if path not in seen:
            seen.append(path)
    return seen, False


def find_browser() -> Browser:
    """A working Chrome and a chromedriver of its major version (see the module docstring)."""
    tried: list[str] = []
    binaries, explicit_binary = _candidates("MINIWOB_CHROME_BINARY", BROWSER_NAMES,
                                            [str(GOOGLE_CHROME), *_cached("chrome", "chrome")])
    drivers, explicit_driver = _candidates("MINIWOB_CHROMEDRIVER", DRIVER_NAMES, _cached("chromedriver", "chromedriver"))
    driver_versions: dict[str, str] = {}
    for path in drivers:
        version, why = _check(path)
        if version:
            driver_versions[path] = version
        else:
            tried.append(f"chromedriver {path}{' (MINIWOB_CHROMEDRIVER)' if explicit_driver else ''}: {why}")
    usable_binary = False
    for path in binaries:
        version, why = _check(path)
        if not version:
            tried.append(f"browser {path}{' (MINIWOB_CHROME_BINARY)' if explicit_binary else ''}: {why}")
            continue
        usable_binary = True
        major = version.split(".")[0]
        for driver, driver_version in driver_versions.items():
            if driver_version.split(".")[0] == major:
                return Browser(path, driver, version, driver_version)
        tried.append(f"browser {path} ({version}): no chromedriver of major version {major} "
                     f"(found: {', '.join(f'{d} {v}' for d, v in driver_versions.items()) or 'none'})")
    if not binaries:
        tried.append(f"browser: none of {', '.join(BROWSER_NAMES)} on PATH, no {GOOGLE_CHROME}, nothing in "
                     f"Selenium Manager's cache ({selenium_cache()})")
    if not drivers:
        tried.append(f"chromedriver: not on PATH, nothing in Selenium Manager's cache ({selenium_cache()})")
    what = "usable browser" if not usable_binary else "chromedriver that matches the browser"
    raise BrowserNotFoundError(f"Cannot start MiniWoB++: no {what}. Tried:\n  - " + "\n  - ".join(tried)
                               + f"\n{FIX}")


def usable_browsers() -> list[tuple[str, str]]:
    """(path, version) of every browser candidate that works, in the order `find_browser` tries them."""
    binaries, _ = _candidates("MINIWOB_CHROME_BINARY", BROWSER_NAMES, [str(GOOGLE_CHROME), *_cached("chrome", "chrome")])
    return [(path, version) for path in binaries for version, _ in [_check(path)] if version]


def fetch_driver() -> str:
    """Download (Selenium Manager, Chrome for Testing) the chromedriver of the first usable
    browser's version unless a matching one is installed; returns the driver's path."""
    try:
        return find_browser().driver
    except BrowserNotFoundError:
        browsers = usable_browsers()
        if not browsers:
            raise
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    path, version = browsers[0]
    print(f"[browser] fetching the chromedriver for {path} ({version}) with Selenium Manager", file=sys.stderr)
    SeleniumManager().binary_paths(["--browser", "chrome", "--browser-path", path])
    return find_browser().driver


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--fetch-driver" in argv:
            fetch_driver()
        found = find_browser()
    except BrowserNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 0  # the workbench goes on: commands that need no browser still work
    print(f"export MINIWOB_CHROME_BINARY='{found.binary}' MINIWOB_CHROMEDRIVER='{found.driver}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
