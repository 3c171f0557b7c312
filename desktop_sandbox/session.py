"""The desktop session inside the sandbox (`Desktop`): the X server and window manager, the
episode's home, buses and GNOME session, the watcher of the sandbox's limits, the applications
and what they did, and every operation the action server's routes call.
"""
from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from desktop_sandbox import a11y, confinement, gnome, sudo, windows
from desktop_sandbox.files import path_kinds, read_regular
from desktop_sandbox.http_input import RequestError, safe
from desktop_sandbox.processes import (
    ACTION_TIMEOUT_S, EXECUTE_TIMEOUT_S, action_command, alive, end_all_but, run_command,
)

HOME_DIRS = ("Desktop", "Documents", "Downloads")
"""Created in every fresh home directory."""
LAUNCH_OUTPUT_CHARS = 2000
"""How much of an application's output /setup/launched returns (the end of it)."""
WATCH_INTERVAL_S = 0.05
"""How often the watcher counts the sandbox's processes (namespaces mode)."""
WATCH_DETAIL_EVERY = 5
"""Every this many rounds it also counts threads and resident memory (user mode: processes too)."""
RESET_DEADLINE_S = 20.0
"""A reset that cannot end every process of the episode within this long fails (HTTP 500)."""
OPENBOX_CONFIG = Path(__file__).with_name("openbox-rc.xml")
PYTHON_ENVIRONMENT = ("LD_LIBRARY_PATH",)
"""Of the server's own environment, what the actions' interpreter (the server's) is given too: the
sandbox's staged interpreter finds its libpython by it (runtime.py). The applications never get it."""

OPEN_TIMEOUT_S = 30.0
"""/setup/open_file waits this long for the file's window by default (OSWorld's newer server: 1800 s)."""
ACTIVATE_WAIT_S = 15.0
"""/setup/activate_window waits this long for a window that matches (window_action). VS Code here
is code-server and a Chromium application window: on a loaded 2-core machine its window came
after 5 s in every vs_code task of a census run (the set-up's activate_window then found nothing)."""
CRASH_SIGNALS = frozenset(int(s) for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                                           signal.SIGKILL))
"""The signals that end a program in a crash (SIGKILL: the kernel's out-of-memory killer's)."""


class Desktop:
    """The X server, the window manager and every application started for the agent.

    `agent` is None in namespaces mode (everything runs as the sandbox's one user) or (uid, gid) in
    user mode (applications and trusted commands run as that uid)."""

    def __init__(self, screen: tuple[int, int], home: Path, wm: str | None, *, runtime_dir: Path, log_dir: Path,
                 agent: tuple[int, int] | None = None, display: str | None = None, bin_dir: str | None = None,
                 a11y_missing: str | None = "not asked for") -> None:
        self.screen, self.home, self.agent, self.runtime_dir = screen, home, agent, runtime_dir
        self.wallpaper: str | None = None
        """The path /setup/change_wallpaper was given (served back by /wallpaper)."""
        self.recording: tuple[subprocess.Popen, Path] | None = None
        self.python_path: list[str] = []
        """Site directories the actions' isolated interpreter adds (the host's, where PYTHONPATH set them)."""
        self.logs = log_dir
        """Output of launched applications; in user mode a directory only the server may write (the
        agent could otherwise turn it into a link and have root write where it points)."""
        self.xvfb, self.display = self._start_x(display)
        self.env = {"HOME": str(home), "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash",
                    "PATH": (f"{bin_dir}:" if bin_dir else "") + "/usr/local/bin:/usr/bin:/bin",
                    "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                    "DISPLAY": self.display, "NO_AT_BRIDGE": "1", "XDG_RUNTIME_DIR": str(runtime_dir),
                    "PYTHONDONTWRITEBYTECODE": "1"}
        if bin_dir:  # the default applications xdg-open uses (confinement.XDG_DEFAULTS), read-only
            xdg = f"{bin_dir}/{confinement.XDG_DIR}"
            self.env.update(XDG_CONFIG_DIRS=f"{xdg}:/etc/xdg", XDG_DATA_DIRS=f"{xdg}:/usr/local/share:/usr/share")
        self.gnome: gnome.Session | None = None
        """The GNOME session (wm "gnome"), started anew at every reset; None with openbox."""
        if wm == "gnome":
            if agent is not None or not bin_dir:
                raise RuntimeError("the GNOME desktop runs in the namespaces isolation only")
            self.env.update(gnome.environment(f"{bin_dir}/{gnome.SESSION_DIR_NAME}", self.env.get(
                "XDG_DATA_DIRS", "/usr/local/share:/usr/share"), self.env.get("XDG_CONFIG_DIRS", "/etc/xdg")))
            self.gnome = gnome.Session(self._as_agent, log_dir, self.tap_key, self.screen_drawn)
            wm = None
            if a11y_missing:  # GNOME needs its session bus whatever the accessibility reader lacks
                a11y_missing = f"{a11y_missing} (the GNOME session's buses run)"
        self.wm = None
        if wm:
            command = [wm, "--config-file", str(OPENBOX_CONFIG)] if Path(wm).name == "openbox" else [wm]
            self.wm = subprocess.Popen(command, env={**self.env, "HOME": "/nonexistent"}, cwd="/",
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._wait_for_window_manager(deadline=time.monotonic() + 30)
        self.a11y_missing = a11y_missing
        """Why the accessibility tree is not served (None: it is, and the episode has its buses)."""
        self.bus_error: str | None = None
        """Why the episode's session bus did not start (None: it did)."""
        bus_config = f"{bin_dir}/{gnome.SESSION_DIR_NAME}/session-bus.conf" if self.gnome else a11y.BUS_CONFIG
        self.buses = None if a11y_missing and self.gnome is None else a11y.Buses(runtime_dir, self._as_agent, bus_config)
        if self.buses is not None:
            del self.env["NO_AT_BRIDGE"]  # GTK's bridge to AT-SPI on (start_buses adds the rest)
        self.keep = {os.getpid(), self.xvfb.pid} | ({self.wm.pid} if self.wm else set())
        self.launched: list[subprocess.Popen] = []
        """Applications started by /setup/launch, reaped once they end."""
        self.launch_records: list[tuple[Any, subprocess.Popen, Path]] = []
        """(command, process, output log) of every application launched since the last reset."""
        self._input_lock = threading.Lock()
        self.reset_lock = threading.Lock()
        """Held while the episode's processes are being ended (a reset, or the watcher)."""
        self.incidents: list[str] = []
        """What the watcher did since the last reset ("pids limit: ...")."""
        self.root_broker: sudo.BrokerChannel | None = None
        """With root inside: this server's channel to the root broker, which ends the episode's
        processes for it (root's among them, which this server, as `user`, may not signal)."""
        self.crashes_said: set[int] = set()
        """The pids of crashed applications `crashed_applications` has reported."""
        self.setup_log: list[dict[str, Any]] = []
        """The task's set-up steps since /setup/begin (or the reset): what each asked, and whether
        it did it (`setup_report`)."""
        self.setup_launches = 0
        """Where this set-up's applications start in `launch_records`."""
        self.fresh_home()
        self.start_buses()
        self.start_session()

    # -- start-up ----------------------------------------------------------------------------
    def _start_x(self, display: str | None) -> tuple[subprocess.Popen, str]:
        """Xvfb on `display`, or on the first free display it finds (-displayfd) when None."""
        read_fd, write_fd = os.pipe()
        # no X screensaver, no DPMS: the screen never blanks while an episode waits on a slow update
        command = ["Xvfb", "-screen", "0", f"{self.screen[0]}x{self.screen[1]}x24", "-nolisten", "tcp", "-noreset",
                   "-s", "0", "-dpms"]
        command = [*command[:1], display, *command[1:]] if display else [*command, "-displayfd", str(write_fd)]
        xvfb = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                pass_fds=() if display else (write_fd,), cwd="/")
        os.close(write_fd)
        deadline = time.monotonic() + 30
        if display is None:
            with os.fdopen(read_fd) as announced:
                number = announced.readline().strip()
            if not number:
                raise RuntimeError(f"Xvfb did not start (exit {xvfb.poll()})")
            display = f":{number}"
        else:
            os.close(read_fd)
        while not Path(f"/tmp/.X11-unix/X{display.lstrip(':')}").exists():
            if xvfb.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Xvfb {display} did not start (exit {xvfb.poll()})")
            time.sleep(0.05)
        return xvfb, display

    def _wait_for_window_manager(self, deadline: float) -> None:
        """Until the window manager announces itself (_NET_SUPPORTING_WM_CHECK on the root window):
        a window mapped before that may stay unmapped for good."""
        from Xlib import X, display  # python-xlib: pyautogui's own X library

        connection = display.Display(self.display)
        try:
            root = connection.screen().root
            atom = connection.intern_atom("_NET_SUPPORTING_WM_CHECK")
            while root.get_full_property(atom, X.AnyPropertyType) is None:
                if self.wm.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the window manager did not start (exit {self.wm.poll()})")
                time.sleep(0.05)
        finally:
            connection.close()

    # -- the episode -------------------------------------------------------------------------
    def fresh_home(self) -> None:
        """Empty the home directory and give it the usual folders (as the agent's user)."""
        if self.agent is None:
            for child in self.home.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            for name in HOME_DIRS:
                (self.home / name).mkdir(exist_ok=True)
            if self.gnome is not None:
                gnome.seed_home(self.home)
        else:  # as the agent's uid: root must not follow links the agent left in its home
            names = " ".join(HOME_DIRS)
            self.run(f"find . -mindepth 1 -delete 2>/dev/null; rm -rf ./* ./.[!.]* 2>/dev/null; mkdir -p {names}",
                     shell=True, timeout=60)
        self.launch_records = []
        self.incidents = []
        self.crashes_said = set()
        self.begin_setup()
        shutil.rmtree(self.logs, ignore_errors=True)

    def start_buses(self) -> None:
        """The episode's session and accessibility buses (a reset ended the previous ones), where
        the accessibility tree is served; the applications' environment names them. A bus that
        does not start costs the episode its tree (/accessibility says why), not its applications."""
        if self.buses is None:
            return
        self.env.pop("AT_SPI_BUS_ADDRESS", None)
        try:
            self.buses.start()
            self.bus_error = None
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            self.bus_error = str(e)
        self.env.update(self.buses.environment())

    def begin_setup(self) -> None:
        """From here on, trusted calls are the task's set-up (/setup/begin: after the provider's own
        preparation of the home, which is not the task's)."""
        self.setup_log = []
        self.setup_launches = len(self.launch_records)

    def note_setup(self, step: str, what: Any, why_failed: str | None = None) -> None:
        """Record one set-up call: `why_failed` None when it did what it asked."""
        entry = {"step": step, "what": safe(what if isinstance(what, str) else json.dumps(what))[:300],
                 "ok": why_failed is None}
        if why_failed is not None:
            entry["error"] = safe(why_failed)[:500]
        if len(self.setup_log) < SETUP_LOG_MAX:
            self.setup_log.append(entry)

    def setup_report(self) -> dict[str, Any]:
        """The set-up's steps and, in `failures`, each one that did not do what it asked: a command
        that exited non-zero (but `pkill`/`killall` finding nothing), a window to activate or close
        that was not there, a file to open that did not open, an upload or wallpaper that failed, a
        launched program that exited with an error (its output's tail)."""
        steps = list(self.setup_log)
        for command, process, log_path in self.launch_records[self.setup_launches:]:
            code = process.poll()
            entry = {"step": "launch", "what": safe(json.dumps(command))[:300], "ok": not code, "returncode": code}
            if code:
                entry["error"] = f"exited with code {code}: {_tail(log_path)}"
            steps.append(entry)
        failures = [f"{e['step']} {e['what']}: {e['error']}" for e in steps if not e["ok"]]
        return {"steps": steps, "failures": failures}

    def start_session(self) -> None:
        """The desktop's session of the episode (GNOME: the shell and its daemons; with openbox,
        nothing: the window manager outlives episodes). A session that does not start leaves the
        episode without a desktop: `session_error` says why, /health and the next action report it."""
        if self.gnome is None:
            return
        try:
            self.gnome.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            self.incidents.append(f"the GNOME session did not start: {e}")

    def screen_drawn(self) -> bool:
        """Whether the middle of the screen is anything but black (a desktop drew its background)."""
        from PIL import ImageGrab

        x, y = self.screen[0] // 2, self.screen[1] // 2
        pixel = ImageGrab.grab(bbox=(x, y, x + 1, y + 1), xdisplay=self.display).convert("RGB").getpixel((0, 0))
        return pixel != (0, 0, 0)

    def tap_key(self, keysym: str = "Shift_L") -> None:
        """Press and release one key (through XTEST, as the agent's actions do)."""
        from Xlib import X, XK, display
        from Xlib.ext import xtest

        with self._input_lock:
            connection = display.Display(self.display)
            try:
                code = connection.keysym_to_keycode(XK.string_to_keysym(keysym))
                xtest.fake_input(connection, X.KeyPress, code)
                xtest.fake_input(connection, X.KeyRelease, code)
                connection.sync()
            finally:
                connection.close()

    def ensure_buses(self) -> None:
        """Start the buses again where the watcher, or the agent, ended them."""
        if self.buses is not None and not self.buses.alive():
            with self.reset_lock:  # not while a reset ends the episode's processes (it starts new ones)
                if not self.buses.alive():
                    self.start_buses()

    def watch(self, pids: int, total_memory_mib: int, stop: threading.Event) -> None:
        """Until `stop`: every WATCH_INTERVAL_S count the processes of the sandbox's PID namespace
        (a directory listing: cheap, so a fork bomb is caught while it is small), and every
        WATCH_DETAIL_EVERY rounds the episode's threads and resident memory; above a limit, end
        every program of the episode (a fork bomb or a memory hog ends its own episode's
        applications, never the machine) and record why."""
        page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
        rounds = 0
        while not stop.wait(WATCH_INTERVAL_S):
            rounds += 1
            why = None
            if self.agent is None:  # /proc is the sandbox's own: every entry is one of its processes
                count = sum(1 for e in os.scandir("/proc") if e.name.isdigit()) - len(self.keep) - 1
                if count > pids:
                    why = f"pids limit: {count} processes > {pids}"
            if why is None and rounds % WATCH_DETAIL_EVERY == 0:
                tasks, rss_mib = self._usage(page_mib)
                if tasks > pids:
                    why = f"pids limit: {tasks} threads > {pids}"
                elif rss_mib > total_memory_mib:
                    why = f"memory limit: {rss_mib:.0f} MiB > {total_memory_mib} MiB"
            if why is None:
                continue
            try:
                with self.reset_lock:
                    # the server's own kill, not a crash: the incident says why they ended
                    self.crashes_said.update(process.pid for _, process in self._watched())
                    ended = self.end_applications()
            except RuntimeError as e:
                why += f" ({e})"
                ended = 0
            self.incidents.append(f"{why}: ended the episode's {ended} processes")

    def activity(self) -> dict[str, Any]:
        """What a reset's settling watches: the top-level windows and the CPU seconds the episode's
        processes (the desktop's session included) have used so far."""
        ticks = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.keep or entry.name == "1":
                continue
            try:
                if self.agent is not None and entry.stat().st_uid != self.agent[0]:
                    continue
                with open(f"/proc/{entry.name}/stat") as f:
                    after_name = f.read().rsplit(")", 1)[1].split()
                ticks += int(after_name[11]) + int(after_name[12])  # utime, stime
            except (OSError, IndexError, ValueError):
                continue
        return {"windows": [[w.title, w.width, w.height] for w in windows.list_windows(self.display)],
                "cpu_s": ticks / os.sysconf("SC_CLK_TCK")}

    def _usage(self, page_mib: float) -> tuple[int, float]:
        """Threads and resident MiB of the episode's processes."""
        tasks = rss_pages = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self.keep or pid == 1:
                continue
            try:
                if self.agent is not None and entry.stat().st_uid != self.agent[0]:
                    continue
                with open(f"/proc/{pid}/stat") as f:
                    fields_after_name = f.read().rsplit(")", 1)[1].split()
                tasks += int(fields_after_name[17])
                rss_pages += int(fields_after_name[21])
            except (OSError, IndexError, ValueError):
                continue
        return tasks, rss_pages * page_mib

    def end_applications(self) -> int:
        """End every process of the episode (all but the server, the X server, the window manager
        and the sandbox's init), looping until none is left; returns how many were ended.

        namespaces: processes.end_all_but (one kill(-1, SIGSTOP) freezes every process of the PID
        namespace at once, the desktop's own are continued, the frozen ones killed), done by the
        root broker with root inside (root's processes are out of this server's reach). user:
        kill(-1, SIGKILL) run as the agent's uid ends every process of that uid at once."""
        if self.agent is None:
            ended = self._end_in_namespace()
        else:
            ended = self._end_agent_processes()
        self.launched = [p for p in self.launched if p.poll() is None]  # reap the ended
        return ended

    def _end_in_namespace(self) -> int:
        if self.root_broker is not None:
            try:
                return self.root_broker.end_all_but(self.keep, RESET_DEADLINE_S)
            except OSError:  # the broker is gone (root inside can end it): what this server may signal
                self.root_broker = None
        return end_all_but(self.keep, RESET_DEADLINE_S)

    def _end_agent_processes(self) -> int:
        ended: set[int] = set()
        deadline = time.monotonic() + RESET_DEADLINE_S
        while True:
            others = self._agent_processes()
            if not others:
                return len(ended)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(others)} processes of the episode survived {RESET_DEADLINE_S:.0f} s of killing")
            self.run(["/bin/sh", "-c", "kill -KILL -1"], False, 10)
            ended.update(others)
            wait_until = time.monotonic() + 5
            while time.monotonic() < wait_until and any(alive(p) for p in self._agent_processes()):
                time.sleep(0.02)

    def _agent_processes(self) -> list[int]:
        """User mode: live processes of the agent's uid."""
        assert self.agent is not None
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self.keep or pid == 1 or not alive(pid):
                continue
            if confinement.process_uid(pid) != self.agent[0]:
                continue
            pids.append(pid)
        return pids

    # -- what the endpoints do ---------------------------------------------------------------
    def screenshot_png(self) -> bytes:
        from PIL import ImageGrab

        image = ImageGrab.grab(xdisplay=self.display)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    def _as_agent(self) -> dict[str, Any]:
        """subprocess arguments that run a command as the agent's user, in its home."""
        kwargs: dict[str, Any] = {"env": self.env, "cwd": self.home}
        if self.agent is not None:
            kwargs.update(user=self.agent[0], group=self.agent[1], extra_groups=[])
        return kwargs

    def run(self, command: list[str] | str, shell: bool, timeout: float) -> dict[str, Any]:
        """A trusted command (set-up, checker), as the agent's user, in its home (OSWorld's commands
        use relative paths). Python started by it does not look in the home for modules (safe path,
        no user site): OSWorld's set-up and checkers run `python -c "import pyautogui; ..."`, which
        a pyautogui.py the agent saved there would otherwise replace."""
        kwargs = self._as_agent()
        kwargs["env"] = {**kwargs["env"], "PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}
        return run_command(self.as_arguments(command, shell), shell=shell, timeout=timeout, **kwargs)

    def as_arguments(self, command: list[str] | str, shell: bool) -> list[str] | str:
        """As OSWorld's VM server takes a command: a string without a shell is split shell-style,
        and each argument starting with `~/` names a path in the home."""
        if shell:
            return command[0] if isinstance(command, list) and len(command) == 1 else command
        parts = shlex.split(command) if isinstance(command, str) else list(command)
        return [self.expand(p) if p.startswith("~/") else p for p in parts]

    def run_action(self, code: str, cpu_s: int) -> dict[str, Any]:
        """Checked agent code in an isolated interpreter started from / (nothing the agent wrote can
        shadow a module), with a CPU-time limit; keys and buttons left held are released after."""
        env = {k: v for k, v in self.env.items() if k != "HOME"} | {"HOME": "/nonexistent"}
        env |= {k: os.environ[k] for k in PYTHON_ENVIRONMENT if k in os.environ}  # what this interpreter needs
        try:
            return run_command(action_command(sys.executable, code, cpu_s, self.python_path), shell=False,
                        timeout=ACTION_TIMEOUT_S, env=env, cwd="/")
        finally:
            self.release_input()

    def release_input(self) -> list[str]:
        """Release every key and mouse button still held (an action may press keyDown('shift') and
        never release it, or be killed mid-drag): nothing held carries into the next action."""
        from Xlib import X, display
        from Xlib.ext import xtest

        released = []
        with self._input_lock:
            connection = display.Display(self.display)
            try:
                for index, byte in enumerate(connection.query_keymap()):
                    for bit in range(8):
                        if byte & (1 << bit):
                            xtest.fake_input(connection, X.KeyRelease, index * 8 + bit)
                            released.append(f"key {index * 8 + bit}")
                mask = connection.screen().root.query_pointer().mask
                for button, flag in ((1, X.Button1Mask), (2, X.Button2Mask), (3, X.Button3Mask)):
                    if mask & flag:
                        xtest.fake_input(connection, X.ButtonRelease, button)
                        released.append(f"button {button}")
                connection.sync()
            finally:
                connection.close()
        return released

    def launch(self, command: list[str] | str, shell: bool) -> None:
        """Start an application and return; its output goes to a log that `launched` reads, so a
        window that never appears can be explained (a crash, a missing library, a bad argument)."""
        self.launched = [p for p in self.launched if p.poll() is None]
        self.ensure_buses()
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{len(self.launch_records)}.log"
        with open(log_path, "wb") as log:  # OSError (e.g. no such program) goes to the caller: HTTP 500
            process = subprocess.Popen(self.as_arguments(command, shell), shell=shell, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True, **self._as_agent())
        self.launched.append(process)
        self.launch_records.append((command, process, log_path))

    def _watched(self) -> list[tuple[str, subprocess.Popen]]:
        """(what, process) for the task's applications (launched by its set-up) and the desktop's
        own programs (GNOME Shell and its session's daemons)."""
        out = [(safe(json.dumps(command))[:200], process) for command, process, _ in self.launch_records]
        if self.gnome is not None:
            out += [(f"the desktop's {name}", process) for name, process in self.gnome.processes.items()]
        return out

    def crashed_applications(self) -> list[str]:
        """The task's applications (launched by its set-up) and the desktop's own programs (GNOME
        Shell: without it the windows stay and nothing manages them) that a crash's signal ended,
        each said once: the episode lost them to the machine, not to the agent (a window the agent
        closes, or a program it quits or `pkill`s, exits 0 or on SIGTERM and is not here)."""
        out = []
        for what, process in self._watched():
            code = process.poll()
            number = -code if code is not None and code < 0 else (code - 128 if code and code > 128 else 0)
            if number in CRASH_SIGNALS and process.pid not in self.crashes_said:
                self.crashes_said.add(process.pid)
                out.append(f"{what} (pid {process.pid}) ended on {signal.Signals(number).name}")
        return out

    def launched_applications(self) -> list[dict[str, Any]]:
        """Every application launched since the last reset: command, pid, exit code (None while
        it runs) and the tail of its output."""
        out = []
        for command, process, log_path in self.launch_records:
            try:
                with open(log_path, "rb") as log:
                    log.seek(max(0, log_path.stat().st_size - LAUNCH_OUTPUT_CHARS))
                    output = log.read().decode(errors="replace")
            except OSError:
                output = ""
            out.append({"command": command, "pid": process.pid, "returncode": process.poll(), "output": output})
        return out

    def read_file(self, name: str) -> bytes | None:
        """A file of the desktop (`~/` means the home), read as the agent's user; None if absent.
        Read by this process, never by a program it starts (see `_as_agent_here`)."""
        path = str(self.home / name[2:]) if name.startswith("~/") else name
        if self.agent is None:
            return read_regular(path)
        return self._as_agent_here(read_regular, path)

    def path_info(self, paths: list[str]) -> dict[str, dict[str, Any] | None]:
        """Kind ("dir", "file", or stat's name: "symbolic link", "fifo", ...; a final link not
        followed) and mode of each path (`~/` in the home), None where absent: what the desktop
        tasks' checkers read. Computed by this process, as `read_file`."""
        if self.agent is None:
            return path_kinds(paths, self.expand)
        return self._as_agent_here(path_kinds, paths, self.expand)

    def _as_agent_here(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` with the agent's user's rights (the `user` fallback, where this server is
        root), in a forked child that never executes another program. A checker's `head` or `stat`
        is a process of the agent's user that anything the agent left running may stop and write
        into (its /proc/<pid>/fd/1 is the checker's output pipe): a faked score. A process that
        changed its user is kept undumpable by the kernel, so its /proc entries stay root's."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only system calls and this function, then _exit
            code = 1
            try:
                os.close(read)
                os.setgroups([])
                os.setresgid(self.agent[1], self.agent[1], self.agent[1])
                os.setresuid(self.agent[0], self.agent[0], self.agent[0])
                result = fn(*args)
                data = b"B" + result if isinstance(result, bytes) else b"J" + json.dumps(result).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(write, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        chunks = []
        with os.fdopen(read, "rb") as f:
            while chunk := f.read(1 << 20):
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        data = b"".join(chunks)
        if status != 0 or not data:
            raise OSError(f"reading as the agent's user failed (status {status})")
        return data[1:] if data[:1] == b"B" else json.loads(data[1:])

    def active_window(self) -> dict[str, Any]:
        found = self.run(["xdotool", "getactivewindow", "getwindowname", "getwindowgeometry", "--shell"],
                         False, 10)
        if found["returncode"] != 0:
            return {}
        lines = found["output"].splitlines()
        fields = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
        window_id = int(fields.get("WINDOW", 0))
        wm_class = next((w.wm_class for w in windows.list_windows(self.display) if w.id == window_id), "")
        return {"id": window_id, "name": lines[0] if lines else "", "wm_class": wm_class,
                "x": int(fields.get("X", 0)), "y": int(fields.get("Y", 0)),
                "width": int(fields.get("WIDTH", 0)), "height": int(fields.get("HEIGHT", 0))}

    def accessibility_tree(self, budget_s: float) -> str:
        """The AT-SPI tree in OSWorld's XML (a11y.py); RequestError where it cannot be given."""
        if self.buses is None:
            raise RequestError(501, f"/accessibility is not served here: {self.a11y_missing}")
        self.ensure_buses()
        if not self.buses.alive():
            raise RequestError(502, f"the episode's session bus is not running: {self.bus_error or 'it ended'}")
        try:
            return self.buses.read_tree(budget_s)
        except a11y.TreeError as e:
            raise RequestError(e.status, str(e)) from None

    def terminal_output(self) -> str | None:
        """What OSWorld's server answers at /terminal: the text of the focused terminal of the
        active GNOME Terminal window, read from the accessibility tree (its visible buffer, trailing
        space cut); None when no GNOME Terminal window is active or the tree is not served."""
        import xml.etree.ElementTree as ET

        from desktop_sandbox.a11y_tree import NAMESPACES

        if self.buses is None or self.a11y_missing and self.gnome is None:
            return None
        if not self.active_window().get("wm_class", "").startswith("gnome-terminal-server."):
            return None  # no terminal has the focus: no need to read the whole tree (seconds, at every reset's probe)
        try:
            root = ET.fromstring(self.accessibility_tree(a11y.BUDGET_S))
        except (RequestError, ET.ParseError):
            return None
        state = f"{{{NAMESPACES['st']}}}"
        for application in root.iter("application"):
            if application.get("name") != "gnome-terminal-server":
                continue
            for frame in application.findall("frame"):
                if frame.get(state + "active") != "true":
                    continue
                focused = [t for t in frame.iter("terminal") if t.get(state + "focused") == "true"]
                if len(focused) == 1:
                    return (focused[0].text or "").rstrip()
        return None

    # -- OSWorld's set-up steps and getters ----------------------------------------------------
    def expand(self, path: str) -> str:
        """`~` and `~/...` mean the home (OSWorld's task files use both and absolute paths)."""
        if path == "~":
            return str(self.home)
        return str(self.home / path[2:]) if path.startswith("~/") else path

    def upload(self, path: str, data: bytes) -> None:
        """Write a file as the agent's user, creating its parent directories (OSWorld's newer server
        does; its older one left that to a `mkdir` step, which still works)."""
        done = subprocess.run(["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh",
                               self.expand(path)], input=data, capture_output=True, timeout=600, **self._as_agent())
        if done.returncode != 0:
            raise RequestError(500, f"cannot write {safe(path)}: {safe(done.stderr.decode(errors='replace').strip())}")

    def exists(self, path: str, kind: str = "e") -> bool:
        """Whether the path exists (`kind`: test(1)'s e, f or d), as the agent's user sees it."""
        done = subprocess.run(["/bin/sh", "-c", f'test -{kind} "$1"', "sh", self.expand(path)],
                              capture_output=True, timeout=30, **self._as_agent())
        return done.returncode == 0

    def open_file(self, path: str, timeout: float) -> str | None:
        """Open a file with its default application (xdg-open, as the agent's user) and wait up to
        `timeout` seconds for a window whose title names it (with or without its extension), as
        OSWorld's newer server does. Returns that window's title, None if none appeared."""
        full = self.expand(path)
        self.launch(["xdg-open", full], False)
        name = Path(full).name
        wanted = {name.lower(), Path(name).stem.lower()}
        deadline = time.monotonic() + timeout
        while True:
            for window in windows.list_windows(self.display):
                if any(w in window.title.lower() for w in wanted):
                    return window.title
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def window_action(self, name: str, strict: bool, by_class: bool, action: str) -> list[str]:
        """Activate or close the windows OSWorld's rules designate (windows.py): activate the first,
        close every match (as wmctrl -c closes the first; closing all is what the task files mean
        when they close an application's window by class). Returns the titles acted on.
        Activating waits up to ACTIVATE_WAIT_S for a match: the step usually follows the `launch`
        of the window's program, and GNOME maps a new window a second or more after the launch
        (the VM's wmctrl does not wait; there the launched window takes the focus anyway)."""
        deadline = time.monotonic() + (ACTIVATE_WAIT_S if action == "activate" else 0)
        while True:
            found = windows.find(windows.list_windows(self.display), name, strict=strict, by_class=by_class)
            if found or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if action == "activate":
            found = found[:1]
        for window in found:
            (windows.activate if action == "activate" else windows.close)(self.display, window)
        return [w.title for w in found]

    def window_size(self, app_class_name: str) -> dict[str, int] | None:
        found = windows.find(windows.list_windows(self.display), app_class_name, by_class=True)
        return {"width": found[0].width, "height": found[0].height} if found else None

    def directory_tree(self, path: str, max_entries: int = 20000) -> dict[str, Any]:
        """OSWorld's /list_directory tree: {"type": "directory", "name", "children": [...]},
        recursively; files as {"type": "file", "name"}. Listed as the agent's user (find(1)),
        at most `max_entries` entries (413 above)."""
        full = self.expand(path).rstrip("/") or "/"
        done = subprocess.run(["find", full, "-mindepth", "1", "-printf", "%y %P\\0"], capture_output=True,
                              timeout=60, **self._as_agent())
        if not self.exists(full, "d"):
            raise RequestError(404, f"{safe(path)} is not a directory")
        entries = [e for e in done.stdout.decode(errors="replace").split("\0") if e]
        if len(entries) > max_entries:
            raise RequestError(413, f"{safe(path)} holds more than {max_entries} entries")
        root: dict[str, Any] = {"type": "directory", "name": Path(full).name or "/", "children": []}
        nodes = {"": root}
        for entry in sorted(entries, key=lambda e: e[2:].count("/")):
            kind, rel = entry[0], entry[2:]
            parent_rel, _, name = rel.rpartition("/")
            parent = nodes.get(parent_rel)
            if parent is None:  # under a directory find could not enter
                continue
            node: dict[str, Any] = ({"type": "directory", "name": name, "children": []} if kind == "d"
                                    else {"type": "file", "name": name})
            parent["children"].append(node)
            if kind == "d":
                nodes[rel] = node
        return root

    def execute_with_verification(self, command: list[str] | str, shell: bool, verification: dict[str, Any],
                                  max_wait: float, interval: float) -> dict[str, Any]:
        """OSWorld's newer `execute_with_verification` step: run the command, then poll until a
        window whose title contains `window_exists` appears and/or `command_success` exits 0."""
        result = self.run(command, shell, EXECUTE_TIMEOUT_S)
        deadline = time.monotonic() + max_wait
        while True:
            ok = True
            if verification.get("window_exists"):
                ok = bool(windows.find(windows.list_windows(self.display), str(verification["window_exists"])))
            if ok and verification.get("command_success"):
                ok = self.run(str(verification["command_success"]), True, 30)["returncode"] == 0
            if ok:
                return {**result, "status": "success", "verified": True}
            if time.monotonic() > deadline:
                raise RequestError(500, f"verification {verification!r} did not hold within {max_wait:.0f} s "
                                        f"(command returned {result['returncode']})")
            time.sleep(interval)

    def start_recording(self) -> None:
        """A screen recording (ffmpeg's x11grab), as OSWorld's server makes one."""
        if self.recording is not None and self.recording[0].poll() is None:
            raise RequestError(400, "a recording is already running")
        ffmpeg = shutil.which("ffmpeg", path=self.env["PATH"])
        if ffmpeg is None:
            raise RequestError(501, "/start_recording needs ffmpeg in the sandbox (apt install ffmpeg)")
        out = self.logs / f"recording-{int(time.time())}.mp4"
        self.logs.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([ffmpeg, "-y", "-loglevel", "error", "-f", "x11grab", "-video_size",
                                    f"{self.screen[0]}x{self.screen[1]}", "-i", self.display, "-c:v", "libx264",
                                    "-pix_fmt", "yuv420p", "-preset", "ultrafast", str(out)],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=self.env, cwd="/")
        self.recording = (process, out)

    def end_recording(self) -> bytes:
        if self.recording is None:
            raise RequestError(400, "no recording is running")
        process, out = self.recording
        self.recording = None
        try:
            process.communicate(b"q", timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:
            data = out.read_bytes()
        except OSError:
            raise RequestError(500, "the recording wrote no file") from None
        out.unlink(missing_ok=True)
        return data

    def stop(self) -> None:
        self.end_applications()
        for proc in (self.wm, self.xvfb):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()


SETUP_LOG_MAX = 500
"""Set-up calls recorded per episode at most (a task file has a few dozen)."""
BENIGN_EXITS = {"pkill": {1}, "killall": {1}, "pgrep": {1}}
"""Exit codes that mean "nothing to do" rather than a failure: pkill finding no process to end."""


def execute_failure(command: list[str] | str, done: dict[str, Any]) -> str | None:
    """Why a set-up command did not do what it asked (None: it did)."""
    code = done.get("returncode")
    if code == 0:
        return None
    try:
        words = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError:
        words = []
    if words and code in BENIGN_EXITS.get(Path(words[0]).name, ()):
        return None
    tail = " ".join((done.get("error") or done.get("output") or "").split())[-300:]
    return f"exited with code {code}" + (f": {tail}" if tail else "")


def _tail(path: Path, chars: int = 300) -> str:
    try:
        return " ".join(path.read_bytes()[-chars:].decode(errors="replace").split())
    except OSError:
        return ""
