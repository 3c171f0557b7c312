"""VS Code for OSWorld's vs_code tasks: code-server behind a `code` command (scripts/setup_vscode.sh,
docs/vscode.md), as the tasks' set-ups and getters call it.

Needs the install (`bash scripts/setup_vscode.sh`, which needs npm's registry once); after it,
nothing here uses the network. The window test needs Xvfb, xdotool and Chromium besides. Each test
runs in a home of its own, so nothing reads or writes the real ~/.config/Code."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup_vscode.sh"
INSTALL = Path(os.environ.get("ARPO_VSCODE_HOME", Path.home() / ".cache" / "arpo-workbench" / "vscode"))
CODE = INSTALL / "bin" / "code"
NOT_INSTALLED = None if CODE.is_file() and any(INSTALL.glob("code-server/.installed-*")) else \
    f"code-server is not installed in {INSTALL} (bash scripts/setup_vscode.sh)"


def _node_major() -> str | None:
    node = shutil.which("node")
    if not node:
        return None
    return subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip().split(".")[0]


def _code(home: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "ARPO_CODE_STATE": str(home / "state"), **kwargs.pop("env", {})}
    return subprocess.run([str(CODE), *args], env=env, capture_output=True, text=True, timeout=120, **kwargs)


def _vsix(path: Path, publisher: str = "undefined_publisher", name: str = "test") -> Path:
    """A VSIX as `vsce package` writes one (OSWorld's 0512bb38 installs such a file)."""
    manifest = ('<?xml version="1.0" encoding="utf-8"?><PackageManifest Version="2.0.0" '
                'xmlns="http://schemas.microsoft.com/developer/vsx-schema/2011"><Metadata>'
                f'<Identity Language="en-US" Id="{name}" Version="0.0.1" Publisher="{publisher}"/>'
                f'<DisplayName>{name}</DisplayName></Metadata><Installation><InstallationTarget '
                'Id="Microsoft.VisualStudio.Code"/></Installation><Dependencies/><Assets><Asset '
                'Type="Microsoft.VisualStudio.Code.Manifest" Path="extension/package.json" '
                'Addressable="true"/></Assets></PackageManifest>')
    with zipfile.ZipFile(path, "w") as vsix:
        vsix.writestr("extension.vsixmanifest", manifest)
        vsix.writestr("extension/package.json", json.dumps(
            {"name": name, "publisher": publisher, "version": "0.0.1", "engines": {"vscode": "^1.60.0"}}))
    return path


@pytest.mark.skipif(_node_major() != "v20", reason="the set-up needs node 20 (code-server 4.100.3)")
def test_the_dry_run_says_what_it_would_do_and_creates_nothing(tmp_path):
    target = tmp_path / "vscode"
    done = subprocess.run(["bash", str(SETUP), "--dry-run"], env={**os.environ, "ARPO_VSCODE_HOME": str(target)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"npm install code-server@4.100.3 in {target}/code-server" in done.stderr
    assert not target.exists()


def test_an_unknown_argument_is_refused_by_name():
    done = subprocess.run(["bash", str(SETUP), "--osworld"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "unknown argument --osworld" in done.stderr


@pytest.mark.skipif(bool(NOT_INSTALLED), reason=NOT_INSTALLED or "")
def test_a_vsix_installed_from_a_file_is_listed_then_gone_when_uninstalled(tmp_path):
    """OSWorld's is_extension_installed reads `code --list-extensions | grep <id>`."""
    assert _code(tmp_path, "--list-extensions").stdout.split() == []
    installed = _code(tmp_path, "--install-extension", str(_vsix(tmp_path / "test.vsix")))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert _code(tmp_path, "--list-extensions").stdout.split() == ["undefined_publisher.test"]
    assert (tmp_path / ".vscode" / "extensions").is_dir()  # where VS Code keeps them
    assert _code(tmp_path, "--uninstall-extension", "undefined_publisher.test").returncode == 0
    assert _code(tmp_path, "--list-extensions").stdout.split() == []


@pytest.mark.skipif(bool(NOT_INSTALLED), reason=NOT_INSTALLED or "")
def test_the_command_line_keeps_to_vs_codes_places(tmp_path):
    """Settings under ~/.config/Code (OSWorld's getters read User/settings.json there), and no
    code-server configuration of its own in the home."""
    done = _code(tmp_path, "--version")
    assert done.returncode == 0 and "4.100.3" in done.stdout
    assert (tmp_path / ".config" / "Code" / "User").is_dir()
    assert not (tmp_path / ".config" / "code-server").exists()
    assert not (tmp_path / ".config" / "Code" / "User" / "settings.json").exists()  # the tasks' set-ups write it


WINDOW_TOOLS = [t for t in ("Xvfb", "xdotool") if not shutil.which(t)]
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


def _window_titles(env: dict) -> list[str]:
    found = subprocess.run(["xdotool", "search", "--name", "Visual Studio Code", "getwindowname", "%@"],
                           env=env, capture_output=True, text=True, timeout=30)
    return found.stdout.splitlines()


def _end_process_groups(pid_file: Path) -> None:
    for pid in pid_file.read_text().split() if pid_file.is_file() else []:
        try:
            os.killpg(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.skipif(bool(NOT_INSTALLED or WINDOW_TOOLS or not BROWSER),
                    reason=NOT_INSTALLED or f"needs Xvfb, xdotool and Chromium (missing: {WINDOW_TOOLS or ['chromium']})")
def test_code_opens_a_file_and_a_folder_in_windows_titled_as_vs_codes(tmp_path):
    """The titles OSWorld's activate_window steps look for: "Visual Studio Code" and, for a file
    opened alone, "test.py - Visual Studio Code" (ec71221e's evaluation)."""
    (tmp_path / "Desktop").mkdir()
    (tmp_path / "Desktop" / "test.py").write_text("print(1)\n")
    (tmp_path / "project").mkdir()
    read, write = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1280x800x24", "-nolisten", "tcp"],
                            pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    try:
        with os.fdopen(read) as displayfd:
            env = {"DISPLAY": f":{displayfd.readline().strip()}"}
        assert _code(tmp_path, str(tmp_path / "Desktop" / "test.py"), env=env).returncode == 0
        assert _code(tmp_path, str(tmp_path / "project"), env=env).returncode == 0
        def both_open(titles: list[str]) -> bool:  # a folder's window may show VS Code's walkthrough first
            return "test.py - Visual Studio Code" in titles and any(t.endswith("project - Visual Studio Code")
                                                                    for t in titles)
        deadline = time.monotonic() + 90  # a limit on the wait, not a measurement: the workbench loads in seconds
        titles: list[str] = []
        while time.monotonic() < deadline and not both_open(titles):
            time.sleep(1)
            titles = _window_titles({**os.environ, **env})
        assert both_open(titles), titles
        # the window's title comes from machine settings: the user's settings stay the tasks' own
        assert not (tmp_path / ".config" / "Code" / "User" / "settings.json").exists()
    finally:
        _end_process_groups(tmp_path / "state" / "browser.pid")
        _end_process_groups(tmp_path / "state" / "server.pid")
        xvfb.terminate()
        xvfb.wait(timeout=30)
