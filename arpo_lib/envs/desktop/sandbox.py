"""A private desktop in a bubblewrap sandbox: its own X server, window manager and applications,
no network, a fresh home directory per episode, every process ended on close.

    with Sandbox(screen=(1920, 1080)) as box:
        box.launch(["mousepad"])
        png = box.screenshot()
        box.run_action("import pyautogui\\npyautogui.click(100, 200)")

The sandbox is one `bwrap` process running as its own user (`user`, uid 1000, its own passwd): new user, PID, network, IPC and UTS namespaces, the host's
file system read-only, a private /tmp, and two writable directories bound in from a temporary
directory on the host: the home directory (/home/user) and the channel that holds the
action server's Unix socket. Inside runs `python -m arpo_lib.envs.desktop.server` (server.py),
which starts Xvfb and the window manager; applications are its children. `--die-with-parent` and
the PID namespace guarantee that when this process or the sandbox ends, everything in it ends.
"""
from __future__ import annotations

import functools
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_lib.envs.base import EnvError
from arpo_lib.envs.desktop.server import ACTION_TIMEOUT_S

DESKTOP_TOOLS = ("bwrap", "Xvfb", "openbox", "xdotool")
"""Commands the sandbox needs (Debian packages bubblewrap, xvfb, openbox, xdotool)."""
START_TIMEOUT_S = 60.0
HOME_IN_SANDBOX = "/home/user"
USER_ID = 1000
"""The sandbox's own user `user` (mapped to the caller's uid outside), home /home/user."""
CHANNEL_IN_SANDBOX = "/tmp/channel"  # in the sandbox's private /tmp: the root is read-only


@functools.lru_cache(maxsize=None)
def desktop_unavailable() -> str | None:
    """Why no sandbox can start here (a missing tool, no user namespaces, no Pillow X grab), or None.
    Checked once per process (every sandbox start asks)."""
    for tool in DESKTOP_TOOLS:
        if not shutil.which(tool):
            return (f"{tool} is not installed: the desktop environments need Debian's bubblewrap, xvfb, "
                    "openbox and xdotool (./workbench setup installs them)")
    try:
        from PIL import features
        if not features.check("xcb"):
            return "Pillow was built without XCB: it cannot take screenshots of the X server"
    except ImportError:
        return "Pillow is not installed"
    probe = subprocess.run(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"bubblewrap cannot create namespaces here: {probe.stderr.strip()[:300]}"
    return None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("sandbox", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Sandbox:
    """One private desktop. Raises EnvError when it cannot start or its server stops answering."""

    def __init__(self, screen: tuple[int, int] = (1920, 1080), *, network: bool = False,
                 window_manager: str = "openbox", binds: dict[str, str] | None = None) -> None:
        reason = desktop_unavailable()
        if reason:
            raise EnvError(reason)
        self.screen = screen
        self.workdir = Path(tempfile.mkdtemp(prefix="arpo-desktop-"))
        self.home = self.workdir / "home"
        self.home.mkdir()
        channel = self.workdir / "chan"
        channel.mkdir()
        self.socket_path = str(channel / "server.sock")
        (self.workdir / "passwd").write_text(f"user:x:{USER_ID}:{USER_ID}:Desktop user:{HOME_IN_SANDBOX}:/bin/bash\n"
                                             "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (self.workdir / "group").write_text(f"user:x:{USER_ID}:\nnogroup:x:65534:\n")
        command = ["bwrap", "--die-with-parent", "--new-session", "--unshare-user", "--unshare-pid",
                   "--uid", str(USER_ID), "--gid", str(USER_ID),
                   "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "desktop"]
        if not network:
            command.append("--unshare-net")
        command += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                    "--tmpfs", "/run", "--tmpfs", "/home", "--bind", str(self.home), HOME_IN_SANDBOX,
                    "--bind", str(channel), CHANNEL_IN_SANDBOX, "--ro-bind", str(self.workdir / "passwd"), "/etc/passwd",
                    "--ro-bind", str(self.workdir / "group"), "/etc/group", "--setenv", "HOME", HOME_IN_SANDBOX,
                    "--setenv", "USER", "user", "--setenv", "LOGNAME", "user", "--setenv", "SHELL", "/bin/bash",
                    "--chdir", HOME_IN_SANDBOX]
        for path in code_paths():  # after the private /tmp and /home, which could hide them
            command += ["--ro-bind", path, path]
        for outside, inside in (binds or {}).items():
            command += ["--ro-bind", outside, inside]
        command += [sys.executable, "-m", "arpo_lib.envs.desktop.server", "--socket", f"{CHANNEL_IN_SANDBOX}/server.sock",
                    "--screen", f"{screen[0]}x{screen[1]}", "--home", HOME_IN_SANDBOX, "--wm", window_manager]
        self.log_path = self.workdir / "server.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env={**os.environ, "PYTHONPATH": _repo_root()})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise EnvError(f"the desktop sandbox exited at start (code {self.process.returncode}): {tail}")
            if os.path.exists(self.socket_path):
                try:
                    self.get_json("/health", timeout=2)
                    return
                except (OSError, EnvError):
                    pass
            time.sleep(0.05)
        tail = self._log_tail()
        self.close()
        raise EnvError(f"the desktop sandbox did not answer within {START_TIMEOUT_S:.0f} s: {tail}")

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    # -- HTTP -------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 180.0) -> tuple[int, bytes]:
        if self.process.poll() is not None:
            raise EnvError(f"the desktop sandbox has exited (code {self.process.returncode}): {self._log_tail()}")
        connection = _UnixConnection(self.socket_path, timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            connection.request(method, path, body=payload,
                               headers={"Content-Type": "application/json"} if payload else {})
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            raise EnvError(f"desktop sandbox {method} {path} failed: {e}") from e
        finally:
            connection.close()

    def get_json(self, path: str, timeout: float = 60.0) -> Any:
        status, data = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise EnvError(f"desktop sandbox GET {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    def post_json(self, path: str, body: dict[str, Any], timeout: float = 180.0) -> Any:
        status, data = self.request("POST", path, body, timeout=timeout)
        if status not in (200, 403):
            raise EnvError(f"desktop sandbox POST {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    # -- what environments and checkers use ---------------------------------------------------
    def screenshot(self) -> bytes:
        status, data = self.request("GET", "/screenshot", timeout=60)
        if status != 200:
            raise EnvError(f"screenshot failed: HTTP {status}")
        return data

    def execute(self, command: list[str] | str, shell: bool = False, timeout: float = 120.0) -> dict[str, Any]:
        """Run a trusted command (task set-up, checkers) inside the sandbox and wait for it."""
        return self.post_json("/execute", {"command": command, "shell": shell, "timeout": timeout},
                              timeout=timeout + 30)

    def launch(self, command: list[str] | str, shell: bool = False) -> None:
        self.post_json("/setup/launch", {"command": command, "shell": shell})

    def launched(self) -> list[dict[str, Any]]:
        """The applications launched since the last reset: command, pid, returncode (None while
        running) and the tail of their stdout+stderr."""
        return self.get_json("/setup/launched")

    def read_file(self, path: str) -> bytes | None:
        status, data = self.request("POST", "/file", {"file_path": path})
        return data if status == 200 else None

    def run_action(self, code: str) -> dict[str, Any]:
        """Agent code: the server runs it only if `check_action_code` accepts it (else status 'refused')."""
        return self.post_json("/run_action", {"code": code}, timeout=ACTION_TIMEOUT_S + 30)

    def active_window(self) -> dict[str, Any]:
        return self.get_json("/active_window")

    def reset_session(self) -> int:
        """End every application and empty the home directory; returns how many processes ended."""
        return int(self.post_json("/session/reset", {})["ended"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """End the sandbox and everything in it; remove its directory. Safe to call twice."""
        if self.process.poll() is None:
            try:
                self.request("POST", "/shutdown", {}, timeout=5)
            except EnvError:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MASKED_IN_SANDBOX = ("/tmp", "/run", "/home")
"""Host directories the sandbox replaces with its own (empty) ones."""


def code_paths() -> list[str]:
    """What the action server needs from the host, read-only at the same paths: the repository,
    the Python environment and its base interpreter. Only those under a directory the sandbox
    masks (a clone in /tmp, a venv in /home/...) need binding; the rest of the host is visible
    read-only already."""
    candidates = {_repo_root(), sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    paths = {path for c in candidates for path in (c, os.path.realpath(c))}  # a symlinked path and its target
    masked = {p for p in paths if os.path.isdir(p) and any(p == m or p.startswith(m + "/") for m in MASKED_IN_SANDBOX)}
    return sorted(p for p in masked if not any(p.startswith(q + "/") for q in masked))


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[3])
