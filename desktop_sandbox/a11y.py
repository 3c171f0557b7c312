"""The accessibility tree of a desktop sandbox: the buses its applications expose themselves on,
and the reading that the server's `GET /accessibility` answers with (OSWorld's `{"AT": xml}`).

What an application needs to appear in AT-SPI's tree, and what the sandbox gives it when the tree
can be served (`unavailable()` is None):
- a D-Bus session bus (`Buses`: one per episode, started at every reset, its socket in the
  sandbox's private runtime directory, configured by dbus-session.conf), through which the
  application finds AT-SPI's own bus (at-spi-bus-launcher, started by the session bus and asked
  for its address at once, so that Qt applications, which only look when they start, find it);
- the switch of its toolkit (`APP_ENVIRONMENT`): GTK 3 needs nothing but the absence of
  NO_AT_BRIDGE, GTK 2 (GIMP 2.10) the atk-bridge module, Qt (VLC) two variables, Chromium
  ACCESSIBILITY_ENABLED (the `google-chrome` shim adds --force-renderer-accessibility then, so
  pages are in the tree from the first reading), Thunderbird GNOME_ACCESSIBILITY; LibreOffice is
  in the tree only with its GTK 3 front end (Debian's libreoffice-gtk3; its default X11 one has
  no AT-SPI bridge).

The reader (a11y_tree.py) runs per request, as the agent's user (user mode: the agent's uid), under
the system interpreter, its source handed over on stdin by the server: nothing the agent can
write (its home, /tmp, the PATH, a module named like one the reader imports, the X root window's
AT_SPI_BUS property) changes what runs or which bus it reads (AT_SPI_BUS_ADDRESS is set from the
launcher's answer). It stops itself within its time budget; the server kills it past a grace
period and answers 504, and a crash 502, never a hung request.
"""
from __future__ import annotations

import functools
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

SYSTEM_PYTHON = "/usr/bin/python3"
BUS_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"
READER = Path(__file__).with_name("a11y_tree.py")
BUS_CONFIG = Path(__file__).with_name("dbus-session.conf")
APP_ENVIRONMENT = {"GTK_MODULES": "gail:atk-bridge", "QT_ACCESSIBILITY": "1", "QT_LINUX_ACCESSIBILITY_ALWAYS_ON": "1",
                   "ACCESSIBILITY_ENABLED": "1", "GNOME_ACCESSIBILITY": "1"}
"""What makes each toolkit expose its applications (see the module docstring); GTK_MODULES is what
Debian's and Ubuntu's sessions set (libatk-adaptor's environment.d file)."""
BUDGET_S = 10.0
"""Default time budget of one reading (GET /accessibility?budget_s= asks for another, up to MAX_BUDGET_S)."""
MAX_BUDGET_S = 60.0
GRACE_S = 8.0
"""Past its budget a reader may still be in one D-Bus call (2 s at most), starting (~0.2 s) or
writing; past budget + GRACE_S it is killed."""
START_TIMEOUT_S = 10.0
"""The session bus and the accessibility bus must be up within this long."""


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why this machine cannot serve the accessibility tree (naming the Debian package), or None.
    Checked once per process: every sandbox start asks (the sandbox sees the host's /usr)."""
    for tool, package in (("dbus-daemon", "dbus-daemon"), ("dbus-send", "dbus-bin")):
        if shutil.which(tool) is None:
            return f"the accessibility tree needs {tool} (Debian package {package})"
    if not os.access(BUS_LAUNCHER, os.X_OK):
        return f"the accessibility tree needs {BUS_LAUNCHER} (Debian package at-spi2-core)"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"the accessibility tree is read by {SYSTEM_PYTHON} (Debian package python3), which is missing"
    try:
        probe = subprocess.run([SYSTEM_PYTHON, "-I", "-c", "import pyatspi"], capture_output=True, text=True,
                               timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{SYSTEM_PYTHON} cannot import pyatspi: {e}"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"{SYSTEM_PYTHON} cannot import pyatspi ({last}): install Debian's python3-pyatspi"
    return None


class TreeError(Exception):
    """No tree to answer with: `status` is the HTTP status the server answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Buses:
    """The session bus (and through it AT-SPI's bus) of the current episode, run as the agent's
    user: `spawn()` gives subprocess's keyword arguments for that (env, cwd, and in user mode the
    uid). A reset ends them with every other process of the episode; `start` makes new ones."""

    def __init__(self, runtime_dir: Path, spawn: Callable[[], dict[str, Any]], config: Path | str = BUS_CONFIG) -> None:
        self.runtime_dir = runtime_dir
        self.config = config
        """The session bus's configuration (GNOME's: gnome.SESSION_BUS_CONFIG)."""
        self.address = f"unix:path={runtime_dir / 'bus'}"
        self.places = [str(runtime_dir / "bus"), str(runtime_dir / "at-spi")]
        """Where the session bus and AT-SPI's bus put their sockets (the runtime directory
        outlives an episode, and the agent may write there)."""
        self.spawn = spawn
        self.daemon: subprocess.Popen | None = None
        self.a11y_address: str | None = None
        """AT-SPI's bus, as its launcher answered (None until asked, or when it did not answer)."""
        self.reader_source = READER.read_bytes()

    def environment(self) -> dict[str, str]:
        """What applications get on top of the desktop's environment. AT_SPI_BUS_ADDRESS too, so
        that they never look at the X root window's AT_SPI_BUS property: any X client may set it,
        and the X server outlives the episode (an agent could point the next episode's
        applications at nothing)."""
        found = {"AT_SPI_BUS_ADDRESS": self.a11y_address} if self.a11y_address else {}
        return {"DBUS_SESSION_BUS_ADDRESS": self.address, **APP_ENVIRONMENT, **found}

    def alive(self) -> bool:
        return self.daemon is not None and self.daemon.poll() is None

    def start(self) -> None:
        """A new session bus; returns once it listens and AT-SPI's bus is up (or START_TIMEOUT_S).
        RuntimeError when the session bus does not start."""
        if self.daemon is not None:
            self.daemon.poll()  # reaped (a reset killed it)
        self.a11y_address = None
        kwargs = self._spawn_without_a11y_address()
        kwargs["cwd"] = "/"
        # whatever the agent left where the sockets go (a file named `bus`, a runtime directory
        # it may not write, would stop every later episode's bus): undone as the agent's user
        try:
            subprocess.run(["/bin/sh", "-c", 'chmod u+rwx "$0"; rm -rf -- "$@"', str(self.runtime_dir), *self.places],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=START_TIMEOUT_S, **kwargs)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"cannot clear the runtime directory for the session bus: {e}") from None
        read_fd, write_fd = os.pipe()
        try:
            self.daemon = subprocess.Popen(
                ["dbus-daemon", "--nofork", f"--config-file={self.config}", f"--address={self.address}",
                 f"--print-address={write_fd}"], pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **kwargs)
        finally:
            os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], START_TIMEOUT_S)
            announced = os.read(read_fd, 4096) if ready else b""
        finally:
            os.close(read_fd)
        if not announced:
            if self.daemon.poll() is None:  # still starting after START_TIMEOUT_S: not a bus to keep
                self.daemon.kill()
                self.daemon.wait()
            raise RuntimeError(f"the session bus did not start (dbus-daemon exit {self.daemon.returncode})")
        self.a11y_address = self._ask_a11y_address()

    def _spawn_without_a11y_address(self) -> dict[str, Any]:
        """spawn()'s arguments less the previous episode's AT-SPI bus: the bus daemons pass their
        environment on to what they start, and AT-SPI's registry daemon would try that address
        (whose guid no longer matches) and give up."""
        kwargs = self.spawn()
        kwargs["env"] = {k: v for k, v in kwargs["env"].items() if k != "AT_SPI_BUS_ADDRESS"}
        return kwargs

    def _ask_a11y_address(self) -> str | None:
        """AT-SPI's bus address from its launcher (which the session bus starts for this call)."""
        kwargs = self._spawn_without_a11y_address()
        kwargs["env"]["DBUS_SESSION_BUS_ADDRESS"] = self.address
        try:
            done = subprocess.run(["dbus-send", "--session", "--print-reply=literal", "--reply-timeout=8000",
                                   "--dest=org.a11y.Bus", "/org/a11y/bus", "org.a11y.Bus.GetAddress"],
                                  capture_output=True, text=True, timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL,
                                  **kwargs)
        except subprocess.TimeoutExpired:
            return None
        address = done.stdout.strip()
        return address if done.returncode == 0 and address.startswith("unix:") else None

    def read_tree(self, budget_s: float = BUDGET_S) -> str:
        """The desktop's tree as OSWorld's XML; TreeError when there is none to give."""
        if self.a11y_address is None:
            self.a11y_address = self._ask_a11y_address()
        if self.a11y_address is None:
            raise TreeError(502, "AT-SPI's bus launcher did not answer (the session bus: "
                                 f"{'running' if self.alive() else 'not running'})")
        kwargs = self.spawn()
        kwargs.update(env={**kwargs["env"], **self.environment()}, cwd="/")
        started = time.monotonic()
        try:
            done = subprocess.run([SYSTEM_PYTHON, "-I", "-", f"--budget-s={budget_s:g}"], input=self.reader_source,
                                  capture_output=True, timeout=budget_s + GRACE_S, **kwargs)
        except subprocess.TimeoutExpired:
            raise TreeError(504, f"the accessibility tree was not read within {budget_s + GRACE_S:g} s "
                                 "(the reader was killed)") from None
        except OSError as e:
            raise TreeError(500, f"cannot start the accessibility reader: {e}") from None
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip()[-500:] or f"exit status {done.returncode}"
            raise TreeError(502, f"the accessibility reader failed after {time.monotonic() - started:.1f} s: {why}")
        return done.stdout.decode("utf-8", errors="replace")
