"""A private desktop for a hostile agent: its own X server, window manager and applications, no
network, a fresh home directory per episode, every process ended at each reset and on close.

    with Sandbox(screen=(1920, 1080)) as box:
        box.launch(["mousepad"])
        png = box.screenshot()
        box.run_action("import pyautogui\\npyautogui.click(100, 200)")

What confines it is computed in confinement.py (mounts, environment, seccomp, limits, the
isolation mode); what runs inside is server.py. In the `namespaces` mode the sandbox is one
`bwrap` process running as its own user (`user`, uid 1000, its own passwd) in new user, PID,
network, IPC and UTS namespaces, seeing read-only only the host's system trees and the Python
it needs, with size-capped tmpfs for its home and scratch directories, a seccomp filter and no
nested namespaces; `--die-with-parent` and the PID namespace end everything in it when it ends.
The action server inside listens on a socket the host creates in a private directory and hands
over as a file descriptor: no sandboxed program can reach it. In the `user` fallback the server
runs on the host and the agent's programs as a dedicated uid (confinement.USER_MODE_LOSSES).

The host keeps a private work directory per sandbox (the socket, the log, the sandbox's identity
files); a watcher process removes it, and in user mode ends the agent's processes, when this
process closes the sandbox or dies, even by SIGKILL.
"""
from __future__ import annotations

import fcntl
import functools
import http.client
import json
import logging
import os
import pwd
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
from arpo_lib.envs.desktop import confinement
from arpo_lib.envs.desktop.confinement import HOME_IN_SANDBOX, Limits
from arpo_lib.envs.desktop.server import ACTION_TIMEOUT_S

log = logging.getLogger(__name__)

DESKTOP_TOOLS = ("bwrap", "Xvfb", "openbox", "xdotool")
"""Commands the sandbox needs (Debian packages bubblewrap, xvfb, openbox, xdotool)."""
START_TIMEOUT_S = 60.0
AGENT_UIDS = range(61000, 62000)
"""User mode: the dedicated agent uids (one per sandbox, chosen among those no account and no
process uses)."""
UID_LOCKS = Path("/run/arpo-desktop-uids")
_BOOT = ("import sys; sys.path.insert(0, {path!r}); from arpo_lib.envs.desktop.server import main; "
         "sys.exit(main(sys.argv[1:]))")
"""How the server starts: an isolated interpreter (-I: no environment variables, no user site, no
current directory on sys.path) that imports arpo_lib from the one directory given."""


@functools.lru_cache(maxsize=None)
def desktop_unavailable(isolation: str = "auto") -> str | None:
    """Why no sandbox can start here (a missing tool, no isolation mode, no Pillow X grab, no
    libseccomp), or None. Checked once per process (every sandbox start asks)."""
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
    try:
        mode = confinement.choose_isolation(isolation)
        if mode == "namespaces":
            confinement._seccomp_module()
    except (RuntimeError, ValueError) as e:
        return str(e)
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
    """One private desktop. Raises EnvError when it cannot start or its server stops answering.

    `limits`: confinement.Limits (or a mapping of its fields); `isolation`: "auto", "namespaces"
    or "user" (the dedicated-user fallback, root only); `network`: share the host's network (off:
    loopback only; on, the agent reaches the host's loopback services too)."""

    def __init__(self, screen: tuple[int, int] = (1920, 1080), *, network: bool = False,
                 window_manager: str = "openbox", binds: dict[str, str] | None = None,
                 limits: Limits | dict[str, Any] | None = None, isolation: str = "auto") -> None:
        reason = desktop_unavailable(isolation)
        if reason:
            raise EnvError(reason)
        self.screen = screen
        self.limits = Limits.from_options(limits)
        self.isolation = confinement.choose_isolation(isolation)
        self.network_blocked = not network
        self.agent_uid: int | None = None
        self._uid_lock: int | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="arpo-desktop-"))
        control = self.workdir / "control"  # the socket, the log, the launch logs: the host's only
        control.mkdir(mode=0o700)
        self.socket_path = str(control / "server.sock")
        self.log_path = control / "server.log"
        self._log = open(self.log_path, "wb")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        try:
            if self.isolation == "namespaces":
                command, pass_fds, env, cwd = self._namespaces_command(listener.fileno(), network, window_manager, binds)
            else:
                command, pass_fds, env, cwd = self._user_command(listener.fileno(), network, window_manager)
            self._watcher = self._start_watcher()
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            pass_fds=pass_fds, env=env, cwd=cwd)
        except BaseException:
            listener.close()
            self._cleanup_files()
            raise
        finally:
            for fd in getattr(self, "_fds_to_close", []):
                os.close(fd)
        listener.close()  # the server holds it now
        self._wait_ready()

    # -- starting ------------------------------------------------------------------------------
    def _server_arguments(self, listen_fd: int, window_manager: str) -> list[str]:
        return [sys.executable, "-I", "-c", _BOOT.format(path=str(Path(confinement.arpo_package_dir()).parent)),
                "--listen-fd", str(listen_fd), "--screen", f"{self.screen[0]}x{self.screen[1]}",
                "--wm", window_manager, "--limits", json.dumps(self.limits.as_dict()),
                "--host-pid-namespace", os.readlink("/proc/self/ns/pid")]

    def _namespaces_command(self, listen_fd: int, network: bool, window_manager: str,
                            binds: dict[str, str] | None) -> tuple[list[str], tuple[int, ...], dict[str, str], str]:
        confinement.write_identity_files(self.workdir)
        filter_path = self.workdir / "control" / "seccomp.bpf"
        with open(filter_path, "wb") as out:
            unknown = confinement.seccomp_filter_bpf(out)
        if unknown:
            log.debug("seccomp: this libseccomp does not know %s", unknown)
        seccomp_fd = os.open(filter_path, os.O_RDONLY)
        self._fds_to_close = [seccomp_fd]
        args = confinement.bwrap_arguments(self.workdir, self.limits, network=network, seccomp_fd=seccomp_fd,
                                           binds=binds)
        command = ["bwrap", *args, *self._server_arguments(listen_fd, window_manager), "--display", ":0",
                   "--home", HOME_IN_SANDBOX, "--runtime-dir", "/tmp/runtime", "--log-dir", "/tmp/launched"]
        return command, (listen_fd, seccomp_fd), {"PATH": os.environ.get("PATH", confinement.SANDBOX_PATH)}, "/"

    def _user_command(self, listen_fd: int, network: bool,
                      window_manager: str) -> tuple[list[str], tuple[int, ...], dict[str, str], str]:
        """The fallback: the server on the host as root, the agent's programs as a fresh uid, in a
        home only that uid may enter, with the network blocked for it where iptables works."""
        self.agent_uid, self._uid_lock = _claim_agent_uid()
        self.workdir.chmod(0o711)  # the agent's uid may pass through to its home, nothing else
        for name in ("home", "runtime"):
            path = self.workdir / name
            path.mkdir(mode=0o700)
            os.chown(path, self.agent_uid, self.agent_uid)
        if not network:
            self.network_blocked = _block_network(self.agent_uid, True)
        missing = _unreadable_for(self.agent_uid, [sys.executable, confinement.arpo_package_dir()])
        if missing:
            log.warning("desktop sandbox (user mode): the agent's uid cannot read %s: trusted commands that "
                        "run Python as the agent will fail", missing)
        log.warning("desktop sandbox in the 'user' fallback (no user namespaces here): it does not promise: %s",
                    "; ".join(confinement.USER_MODE_LOSSES))
        command = [*self._server_arguments(listen_fd, window_manager), "--agent-uid", str(self.agent_uid),
                   "--home", str(self.workdir / "home"), "--runtime-dir", str(self.workdir / "runtime"),
                   "--log-dir", str(self.workdir / "control" / "launched"), "--die-with-parent"]
        return command, (listen_fd,), {"PATH": confinement.SANDBOX_PATH, "LANG": "C.UTF-8"}, "/"

    def _start_watcher(self) -> subprocess.Popen:
        """A small shell that waits for this process to close its pipe (on close(), or when the
        kernel closes it because this process died) and then cleans up: the work directory, and in
        user mode the server's process group, every process of the agent's uid and its firewall rule."""
        script = 'read _; '
        if self.isolation == "user":
            script += ('kill -KILL -- -"$2" 2>/dev/null; setpriv --reuid "$1" --regid "$1" --clear-groups '
                       'kill -KILL -1 2>/dev/null; ')
            if self.network_blocked:
                script += " ".join(f'{tool} -w -D OUTPUT -m owner --uid-owner "$1" -j REJECT 2>/dev/null;'
                                   for tool in ("iptables", "ip6tables") if shutil.which(tool))
        script += 'rm -rf -- "$0"'
        # $2, the server's process group, is only known after it starts: the watcher reads it first
        watcher = subprocess.Popen(["/bin/sh", "-c", 'read pgid; set -- "$1" "$pgid"; ' + script,
                                    str(self.workdir), str(self.agent_uid or "")],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        return watcher

    def _wait_ready(self) -> None:
        assert self._watcher.stdin is not None
        self._watcher.stdin.write(f"{self.process.pid}\n".encode())
        self._watcher.stdin.flush()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise EnvError(f"the desktop sandbox exited at start (code {self.process.returncode}): {tail}")
            try:
                self.get_json("/health", timeout=2)
                return
            except (OSError, EnvError):
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
    def request(self, method: str, path: str, body: dict[str, Any] | bytes | None = None,
                timeout: float = 180.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One HTTP request to the server; `body` a JSON-able mapping, or raw bytes as given."""
        if self.process.poll() is not None:
            raise EnvError(f"the desktop sandbox has exited (code {self.process.returncode}): {self._log_tail()}")
        connection = _UnixConnection(self.socket_path, timeout)
        try:
            if isinstance(body, bytes):
                payload, kind = body, (headers or {}).get("Content-Type", "application/octet-stream")
            else:
                payload, kind = (json.dumps(body).encode() if body is not None else None), "application/json"
            connection.request(method, path, body=payload, headers={"Content-Type": kind} if payload is not None else {})
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
        """Run a trusted command (task set-up, checkers) inside the sandbox, as its user, and wait."""
        return self.post_json("/execute", {"command": command, "shell": shell, "timeout": timeout},
                              timeout=timeout + 30)

    def launch(self, command: list[str] | str, shell: bool = False) -> None:
        self.post_json("/setup/launch", {"command": command, "shell": shell})

    def launched(self) -> list[dict[str, Any]]:
        """The applications launched since the last reset: command, pid, returncode (None while
        running) and the tail of their stdout+stderr."""
        return self.get_json("/setup/launched")

    def read_file(self, path: str) -> bytes | None:
        """A file of the desktop (`~/...` in its home), read as the sandbox's user; None if absent."""
        status, data = self.request("POST", "/file", {"file_path": path})
        return data if status == 200 else None

    def run_action(self, code: str) -> dict[str, Any]:
        """Agent code: the server runs it only if `check_action_code` accepts it (else status 'refused')."""
        return self.post_json("/run_action", {"code": code}, timeout=ACTION_TIMEOUT_S + 30)

    def active_window(self) -> dict[str, Any]:
        return self.get_json("/active_window")

    def reset_session(self) -> int:
        """End every application and empty the home directory; returns how many processes ended."""
        return int(self.post_json("/session/reset", {}, timeout=60)["ended"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def report(self) -> dict[str, Any]:
        """How this sandbox is confined: mode, limits, and what the mode does not promise."""
        return {"isolation": self.isolation, "limits": self.limits.as_dict(), "network_blocked": self.network_blocked,
                "agent_uid": self.agent_uid, "seccomp": self.isolation == "namespaces",
                "sized_tmpfs": self.isolation == "namespaces" and "--size" in confinement.bwrap_features(),
                "losses": list(confinement.USER_MODE_LOSSES) if self.isolation == "user" else []}

    def close(self) -> None:
        """End the sandbox and everything in it; remove its directory. Safe to call twice."""
        if getattr(self, "process", None) is not None and self.process.poll() is None:
            try:
                self.request("POST", "/shutdown", {}, timeout=5)
            except EnvError:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._cleanup_files()

    def _cleanup_files(self) -> None:
        if not self._log.closed:
            self._log.close()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher.poll() is None:
            try:
                assert watcher.stdin is not None
                watcher.stdin.close()  # it cleans up (user mode: the agent's uid and its firewall rule)
                watcher.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._uid_lock is not None:
            os.close(self._uid_lock)
            self._uid_lock = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the user-mode fallback --------------------------------------------------------------------

def _claim_agent_uid() -> tuple[int, int]:
    """A uid no account and no process uses, locked for this sandbox (flock, released when the
    descriptor closes or this process dies)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    busy = {_proc_uid(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
    for uid in AGENT_UIDS:
        if uid in busy:
            continue
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        fd = os.open(UID_LOCKS / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise EnvError(f"no free agent uid in {AGENT_UIDS.start}..{AGENT_UIDS.stop - 1}")


def _proc_uid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def _block_network(uid: int, block: bool) -> bool:
    """Add (or remove) a firewall rule rejecting every packet the uid sends; whether it holds."""
    tools = [t for t in ("iptables", "ip6tables") if shutil.which(t)]
    if not tools:
        return False
    ok = True
    for tool in tools:
        done = subprocess.run([tool, "-w", "-A" if block else "-D", "OUTPUT", "-m", "owner", "--uid-owner", str(uid),
                               "-j", "REJECT"], capture_output=True)
        ok = ok and done.returncode == 0
    return ok and block


def _unreadable_for(uid: int, paths: list[str]) -> list[str]:
    """Those of `paths` the uid cannot reach (a directory on the way without search permission)."""
    missing = []
    for path in paths:
        done = subprocess.run(["test", "-r", path], user=uid, group=uid, extra_groups=[], capture_output=True)
        if done.returncode != 0:
            missing.append(path)
    return missing
