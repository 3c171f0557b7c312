"""Processes for the action server: how checked action code runs, running and signalling
commands, the PID-namespace guard of kill(-1), liveness that counts every thread, and the
server's own hardening (undumpable, ended with its parent, the sandbox's limits).
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


ACTION_TIMEOUT_S = 60.0
"""One agent action (a pyautogui snippet) may take this long; OSWorld's server allows 120 s."""
EXECUTE_TIMEOUT_S = 120.0
"""Default limit of a trusted /execute command."""
DESKTOP_THREADS = 64
"""Headroom for the desktop's own threads (server, X server, window manager) in RLIMIT_NPROC."""

ACTION_PREAMBLE = "import pyautogui; pyautogui.FAILSAFE = False; pyautogui.PAUSE = 0.05\n"


def action_command(python: str, code: str, cpu_s: int, python_path: list[str],
                   preamble: str = ACTION_PREAMBLE) -> list[str]:
    """The command that runs checked action code: `python -I` (no environment variables, no user
    site, nothing from the current directory), the site directories put back, RLIMIT_CPU set
    before anything of the action runs, then pyautogui and the code."""
    head = (f"import sys; sys.path[:0] = {python_path!r}\n"
            f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s}))\n")
    return [python, "-I", "-c", head + preamble + code]


def run_command(command: list[str] | str, *, shell: bool, timeout: float, **kwargs: Any) -> dict[str, Any]:
    try:
        done = subprocess.run(command, shell=shell, capture_output=True, text=True, errors="replace",
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    except subprocess.TimeoutExpired as e:
        return {"status": "error", "output": as_text(e.stdout), "error": f"timed out after {timeout:.0f} s",
                "returncode": -1}
    except (OSError, ValueError) as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": -1}
    return {"status": "success" if done.returncode == 0 else "error", "output": done.stdout,
            "error": done.stderr, "returncode": done.returncode}


def send_signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


HOST_PID_NAMESPACE: str | None = None
"""The host's PID namespace (passed by the host): kill(-1) is refused there."""


def require_own_pid_namespace() -> None:
    """kill(-1) must only ever run inside the sandbox's own PID namespace: on a host, as root, it
    would signal every process of the machine."""
    own = os.readlink("/proc/self/ns/pid")
    if HOST_PID_NAMESPACE is None or own == HOST_PID_NAMESPACE or os.getpid() == 1:
        raise RuntimeError(f"refusing kill(-1): not in the sandbox's own PID namespace ({own})")


def end_all_but(keep: set[int], deadline_s: float) -> int:
    """End every process of this PID namespace this process may signal, but those of `keep`, the
    namespace's init and this process, looping until none is left; how many were ended. One
    kill(-1, SIGSTOP) freezes them all at once (none can fork after it), those of `keep` are
    continued, the frozen ones killed. RuntimeError when some are left after `deadline_s` seconds
    (processes of another user, which this one may not signal)."""
    ended: set[int] = set()
    deadline = time.monotonic() + deadline_s
    while True:
        others = _others(keep)
        if not others:
            return len(ended)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(others)} processes of the episode survived {deadline_s:.0f} s of killing")
        require_own_pid_namespace()
        os.kill(-1, signal.SIGSTOP)
        for pid in keep - {os.getpid()}:
            send_signal(pid, signal.SIGCONT)
        for pid in _others(keep):
            if send_signal(pid, signal.SIGKILL):
                ended.add(pid)
        wait_until = time.monotonic() + 5
        while time.monotonic() < wait_until and any(alive(p) for p in _others(keep)):
            time.sleep(0.02)


def _others(keep: set[int]) -> list[int]:
    """Live processes of this PID namespace but `keep`, its init and this process."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            if pid not in keep and pid != 1 and pid != os.getpid() and alive(pid):
                pids.append(pid)
    return pids


def alive(pid: int) -> bool:
    """Whether any thread of process `pid` has not exited. The main thread of a multi-threaded
    application turns zombie before its other threads have exited and released its files: until
    then its sockets still accept connections. (A PCManFM killed at a reset kept its
    single-instance socket open for that long; the next episode's PCManFM handed its window
    request to the dying one and exited: a black screen in ~1 in 10 resets.)"""
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for thread in threads:
        try:
            if (thread / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue
    return False


def as_text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def no_dump() -> None:
    """Make this process undumpable: other processes of the same uid can no longer read its memory,
    open its /proc files or take its descriptors (the listening socket among them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_DUMPABLE = 4
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def die_with_parent() -> None:
    """SIGKILL this process when the host process that started it ends (user mode; in namespaces
    mode bubblewrap's --die-with-parent does it). The sandbox's watcher ends the rest."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


def set_limits(limits: dict[str, int]) -> None:
    """The sandbox's resource limits, on this process (every process it starts inherits them).
    In user mode this process is root, which the kernel exempts from RLIMIT_NPROC; the agent's uid,
    which its children switch to, is not."""
    mib = 2**20
    for which, value in ((resource.RLIMIT_NPROC, limits["pids"] + DESKTOP_THREADS), (resource.RLIMIT_DATA, limits["memory_mib"] * mib),
                         (resource.RLIMIT_FSIZE, limits["file_mib"] * mib), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
