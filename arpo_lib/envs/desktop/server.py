"""The action server of a desktop sandbox (see sandbox.py): it starts the X server and the window
manager, then answers HTTP on a listening socket the host hands it as a file descriptor. No path
of that socket exists where the sandbox's programs could see it: only the host can call it.

Its endpoints follow OSWorld's VM server (desktop_env/server, from its documented behaviour; none
of its code is used) where one exists, so OSWorld's set-up steps and getters map onto it:

    GET  /screenshot            PNG of the whole screen, straight from the X server
    GET  /screen_size           {"width", "height"}
    GET  /platform              "Linux"
    POST /execute               {"command": [...] | "...", "shell": bool, "timeout": s}
                                -> {"status", "output", "error", "returncode"}   (trusted: task set-up, checkers)
    POST /setup/launch          {"command", "shell"}: start an application and return
    GET  /setup/launched        [{"command", "pid", "returncode" (None: running), "output"}] of this
                                episode's launched applications (output: the tail of their stdout+stderr)
    POST /file                  {"file_path"} (JSON or form) -> the file's bytes (404 if absent)
    POST /run_action            {"code"}: agent actions; only code `check_action_code` accepts runs,
                                in an isolated interpreter (-I, from /), with a CPU-time limit; keys
                                and mouse buttons it leaves held are released after it
    GET  /active_window         {"id", "name", "x", "y", "width", "height"} of the focused window
    GET  /windows               [{"id", "title", "wm_class", "x", "y", "width", "height"}], oldest first
    POST /session/reset         end every application (until none is left), re-create the home empty
    POST /shutdown

The rest of what OSWorld's controllers and getters call, in the encodings they send:

    POST /setup/upload          multipart file_path, file_data: write the file (parents created)
    POST /setup/open_file       {"path", "timeout"}: xdg-open it, wait for a window naming it
    POST /setup/activate_window, /setup/close_window   {"window_name", "strict", "by_class"} (windows.py)
    POST /setup/execute_with_verification   {"command", "shell", "verification", "max_wait_time", ...}
    POST /setup/change_wallpaper {"path"}    POST /wallpaper: its bytes (404 when none was set)
    POST /window_size           form app_class_name -> {"width", "height"} (404: no such window)
    POST /list_directory        {"path"} -> {"directory_tree": {"type", "name", "children"}}
    POST /desktop_path          -> {"desktop_path"}      POST /screen_size, GET|POST /cursor_position
    POST /start_recording, /end_recording   ffmpeg x11grab (501 when the sandbox has no ffmpeg)
    GET  /terminal              {"output": null}: no terminal reader (OSWorld's uses AT-SPI)
    GET  /accessibility         {"AT": xml}: the AT-SPI tree in OSWorld's XML (a11y.py; ?budget_s= its
                                time budget, 10 s by default); 501 naming the missing package where
                                this machine cannot serve it, 504 when a reading overran its budget,
                                502 when it failed
    POST /run_python, /run_bash_script      403: an agent's code, unchecked
    CONNECT 127.0.0.1:<port>    a tunnel to Chrome's DevTools (1337, 9222) or VLC (8080) inside

Every failure is a JSON error with a 4xx/5xx status (a body over MAX_BODY_BYTES: 413).

Two modes (confinement.py): in `namespaces` the server runs inside the bubblewrap sandbox as its
only user, with the sandbox's limits set on itself (its children inherit them); in `user` it runs
on the host as root and starts the applications and the trusted commands as the dedicated agent
uid (`--agent-uid`), while the X server, the window manager and the checked actions stay its own.

Only the Python standard library, Pillow, python-xlib and the command-line tools of the sandbox are
used here: the server starts in well under a second and never imports torch.
"""
from __future__ import annotations

import argparse
import ctypes
import io
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from arpo_lib.envs.desktop import a11y, confinement, gnome, windows
from arpo_lib.envs.desktop.bridge import splice

ACTION_TIMEOUT_S = 60.0
"""One agent action (a pyautogui snippet) may take this long; OSWorld's server allows 120 s."""
EXECUTE_TIMEOUT_S = 120.0
"""Default limit of a trusted /execute command."""
MAX_BODY_BYTES = 8 * 2**20
"""Largest request body accepted (413 above)."""
DRAIN_BYTES = 64 * 2**20
"""A refused body up to this size is read and dropped before the 413 (the client then reads the
answer instead of a reset connection); a larger one gets the 413 and the connection closes."""
HOME_DIRS = ("Desktop", "Documents", "Downloads")
"""Created in every fresh home directory."""
LAUNCH_OUTPUT_CHARS = 2000
"""How much of an application's output /setup/launched returns (the end of it)."""
WATCH_INTERVAL_S = 0.05
"""How often the watcher counts the sandbox's processes (namespaces mode)."""
WATCH_DETAIL_EVERY = 5
"""Every this many rounds it also counts threads and resident memory (user mode: processes too)."""
DESKTOP_THREADS = 64
"""Headroom for the desktop's own threads (server, X server, window manager) in RLIMIT_NPROC."""
RESET_DEADLINE_S = 20.0
"""A reset that cannot end every process of the episode within this long fails (HTTP 500)."""
OPENBOX_CONFIG = Path(__file__).with_name("openbox-rc.xml")


class RequestError(Exception):
    """A request the server refuses: answered as JSON {"error"} with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UnixHTTPServer(ThreadingHTTPServer):
    """HTTP on an already-listening Unix socket handed over by the host."""

    address_family = socket.AF_UNIX
    daemon_threads = True

    def __init__(self, listen_fd: int, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__("", handler, bind_and_activate=False)
        self.socket.close()
        self.socket = socket.socket(fileno=listen_fd)
        self.socket.set_inheritable(False)
        self.server_name, self.server_port = "sandbox", 0

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread can start (the sandbox is at its process limit): answer inline
            self.process_request_thread(request, client_address)


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
                "XDG_DATA_DIRS", "/usr/local/share:/usr/share")))
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
        command = ["Xvfb", "-screen", "0", f"{self.screen[0]}x{self.screen[1]}x24", "-nolisten", "tcp", "-noreset"]
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
        entry = {"step": step, "what": _safe(what if isinstance(what, str) else json.dumps(what))[:300],
                 "ok": why_failed is None}
        if why_failed is not None:
            entry["error"] = _safe(why_failed)[:500]
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
            entry = {"step": "launch", "what": _safe(json.dumps(command))[:300], "ok": not code, "returncode": code}
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

        namespaces: one kill(-1, SIGSTOP) freezes every process of the PID namespace at once (none
        can fork after it), the desktop's own are continued, the frozen ones killed; repeated until
        the namespace holds only the desktop. user: kill(-1, SIGKILL) run as the agent's uid ends
        every process of that uid at once."""
        ended: set[int] = set()
        deadline = time.monotonic() + RESET_DEADLINE_S
        while True:
            others = self._others()
            if not others:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(others)} processes of the episode survived {RESET_DEADLINE_S:.0f} s of killing")
            if self.agent is None:
                _require_own_pid_namespace()
                os.kill(-1, signal.SIGSTOP)
                for pid in self.keep - {os.getpid()}:
                    _signal(pid, signal.SIGCONT)
                for pid in self._others():
                    if _signal(pid, signal.SIGKILL):
                        ended.add(pid)
            else:
                self.run(["/bin/sh", "-c", "kill -KILL -1"], False, 10)
                ended.update(others)
            wait_until = time.monotonic() + 5
            while time.monotonic() < wait_until and any(_alive(p) for p in self._others()):
                time.sleep(0.02)
        self.launched = [p for p in self.launched if p.poll() is None]  # reap the ended
        return len(ended)

    def _others(self) -> list[int]:
        """Live processes of the episode: in namespaces mode every process of the PID namespace
        but the desktop's own and init; in user mode every process of the agent's uid."""
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self.keep or pid == 1 or not _alive(pid):
                continue
            if self.agent is not None and confinement.process_uid(pid) != self.agent[0]:
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
        return _run(self.as_arguments(command, shell), shell=shell, timeout=timeout, **kwargs)

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
        try:
            return _run(action_command(sys.executable, code, cpu_s, self.python_path), shell=False,
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
            return _read_regular(path)
        return self._as_agent_here(_read_regular, path)

    def path_info(self, paths: list[str]) -> dict[str, dict[str, Any] | None]:
        """Kind ("dir", "file", or stat's name: "symbolic link", "fifo", ...; a final link not
        followed) and mode of each path (`~/` in the home), None where absent: what the desktop
        tasks' checkers read. Computed by this process, as `read_file`."""
        if self.agent is None:
            return _path_info(paths, self.expand)
        return self._as_agent_here(_path_info, paths, self.expand)

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
        return {"id": int(fields.get("WINDOW", 0)), "name": lines[0] if lines else "",
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

        from arpo_lib.envs.desktop.a11y_tree import NAMESPACES

        if self.buses is None or self.a11y_missing and self.gnome is None:
            return None
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
            raise RequestError(500, f"cannot write {_safe(path)}: {_safe(done.stderr.decode(errors='replace').strip())}")

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
            raise RequestError(404, f"{_safe(path)} is not a directory")
        entries = [e for e in done.stdout.decode(errors="replace").split("\0") if e]
        if len(entries) > max_entries:
            raise RequestError(413, f"{_safe(path)} holds more than {max_entries} entries")
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


def _execute_failure(command: list[str] | str, done: dict[str, Any]) -> str | None:
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


MAX_UPLOAD_BYTES = 256 * 2**20
"""Largest /setup/upload (OSWorld's task files upload documents, images and short videos)."""
OPEN_TIMEOUT_S = 30.0
"""/setup/open_file waits this long for the file's window by default (OSWorld's newer server: 1800 s)."""
ACTIVATE_WAIT_S = 5.0
"""/setup/activate_window waits this long for a window that matches (window_action)."""
TUNNEL_PORTS = frozenset({1337, 9222, 8080})
"""Ports inside the sandbox the host may tunnel to (CONNECT): Chrome's DevTools as OSWorld's tasks
start it (1337, and 9222 where a task runs socat) and VLC's web interface."""
POSTS_AS_GETS = frozenset({"/screen_size", "/cursor_position"})
"""OSWorld's controller POSTs these without a body."""
MAX_FILE_BYTES = 256 * 2**20
"""/file returns at most this much of a file."""


def _read_regular(path: str) -> bytes | None:
    """At most MAX_FILE_BYTES of a regular file; None if it is absent or not a regular file. Opened
    without blocking: the agent may have put a FIFO where the checker looks, whose plain open would
    wait for a writer forever (the episode then an infrastructure failure instead of a 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES]
    except OSError:
        return None


_KINDS = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "fifo",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "character special file", stat.S_IFBLK: "block special file"}


def _path_info(paths: list[str], expand: Any) -> dict[str, dict[str, Any] | None]:
    """{path: {"kind", "mode"} or None} by lstat, `expand` turning `~/...` into the home's path."""
    info: dict[str, dict[str, Any] | None] = {}
    for path in paths:
        try:
            st = os.lstat(expand(path))
        except (OSError, ValueError):
            info[path] = None
            continue
        info[path] = {"kind": _KINDS.get(stat.S_IFMT(st.st_mode), "unknown"), "mode": stat.S_IMODE(st.st_mode)}
    return info


ACTION_PREAMBLE = "import pyautogui; pyautogui.FAILSAFE = False; pyautogui.PAUSE = 0.05\n"


def action_command(python: str, code: str, cpu_s: int, python_path: list[str],
                   preamble: str = ACTION_PREAMBLE) -> list[str]:
    """The command that runs checked action code: `python -I` (no environment variables, no user
    site, nothing from the current directory), the site directories put back, RLIMIT_CPU set
    before anything of the action runs, then pyautogui and the code."""
    head = (f"import sys; sys.path[:0] = {python_path!r}\n"
            f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s}))\n")
    return [python, "-I", "-c", head + preamble + code]


def _run(command: list[str] | str, *, shell: bool, timeout: float, **kwargs: Any) -> dict[str, Any]:
    try:
        done = subprocess.run(command, shell=shell, capture_output=True, text=True, errors="replace",
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    except subprocess.TimeoutExpired as e:
        return {"status": "error", "output": _text(e.stdout), "error": f"timed out after {timeout:.0f} s",
                "returncode": -1}
    except (OSError, ValueError) as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": -1}
    return {"status": "success" if done.returncode == 0 else "error", "output": done.stdout,
            "error": done.stderr, "returncode": done.returncode}


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


HOST_PID_NAMESPACE: str | None = None
"""The host's PID namespace (passed by the host): kill(-1) is refused there."""


def _require_own_pid_namespace() -> None:
    """kill(-1) must only ever run inside the sandbox's own PID namespace: on a host, as root, it
    would signal every process of the machine."""
    own = os.readlink("/proc/self/ns/pid")
    if HOST_PID_NAMESPACE is None or own == HOST_PID_NAMESPACE or os.getpid() == 1:
        raise RuntimeError(f"refusing kill(-1): not in the sandbox's own PID namespace ({own})")


def _alive(pid: int) -> bool:
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


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def make_handler(desktop: Desktop, stop: threading.Event, action_cpu_s: int) -> type[BaseHTTPRequestHandler]:
    from arpo_lib.actions import UnsafeCodeError, check_action_code

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def address_string(self) -> str:
            return "host"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the host logs what matters
            pass

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, value: Any, status: int = 200) -> None:
            self._send(status, json.dumps(value).encode(), "application/json")

        def _raw(self, limit: int = MAX_BODY_BYTES) -> bytes:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise RequestError(400, "Content-Length is not a number") from None
            if length < 0 or length > limit:
                self.close_connection = True  # an unread body must not be parsed as the next request
                if length <= DRAIN_BYTES:  # read and drop it, so the client can read the answer
                    while length > 0:
                        length -= len(self.rfile.read(min(length, 2**20)) or b"\0" * length)
                raise RequestError(413, f"request body of {self.headers.get('Content-Length')} bytes "
                                        f"(at most {limit})")
            return self.rfile.read(length) if length else b""

        def _body(self) -> dict[str, Any]:
            """JSON, or a form (OSWorld's controller posts /file as form field `file_path`); a POST
            without a body (OSWorld's /screen_size, /desktop_path, ...) is {}."""
            raw = self._raw()
            try:
                if self.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
                    return {k: v[-1] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
                body = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as e:
                raise RequestError(400, f"request body is not JSON: {type(e).__name__}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "request body must be a JSON object")
            return body

        def _guarded(self, answer: Any) -> None:
            """Run one endpoint; every failure becomes a JSON error, never a dropped connection."""
            try:
                answer()
            except RequestError as e:
                self._json({"error": str(e)}, e.status)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            except Exception as e:  # noqa: BLE001 (the server must answer whatever happened)
                try:
                    self._json({"error": f"{type(e).__name__}: {_safe(str(e))}"}, 500)
                except OSError:
                    self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._guarded(self._get)

        def do_POST(self) -> None:  # noqa: N802
            self._guarded(self._post)

        def do_CONNECT(self) -> None:  # noqa: N802
            """A tunnel to a port inside the sandbox (Chrome's DevTools, VLC's web interface): the
            host's loopback bridge (bridge.py) carries OSWorld's CDP and VLC clients through it."""
            host, _, port = self.path.rpartition(":")
            if host not in ("127.0.0.1", "localhost") or not port.isdigit() or int(port) not in TUNNEL_PORTS:
                self.close_connection = True
                self._json({"error": f"no tunnel to {_safe(self.path)} (ports: {sorted(TUNNEL_PORTS)})"}, 403)
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
            except OSError as e:
                self.close_connection = True
                self._json({"error": f"nothing answers on port {port} in the sandbox: {e}"}, 502)
                return
            self.send_response(200, "Connection established")
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            upstream.settimeout(None)
            _splice(self.connection, upstream)

        def _get(self) -> None:
            if self.path == "/screenshot":
                self._send(200, desktop.screenshot_png(), "image/png")
            elif self.path == "/screen_size":
                self._json({"width": desktop.screen[0], "height": desktop.screen[1]})
            elif self.path == "/windows":
                self._json([w.__dict__ for w in windows.list_windows(desktop.display)])
            elif self.path == "/cursor_position":
                self._json(list(windows.cursor_position(desktop.display)))
            elif self.path == "/terminal":
                self._json({"status": "success", "output": desktop.terminal_output()})
            elif self.path.split("?", 1)[0] == "/accessibility":
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                budget = _number({k: _float(v[-1]) for k, v in query.items()}, "budget_s", a11y.BUDGET_S, 0.5,
                                 a11y.MAX_BUDGET_S)
                self._json({"AT": desktop.accessibility_tree(budget)})
            elif self.path == "/platform":
                self._send(200, b"Linux", "text/plain")
            elif self.path == "/active_window":
                self._json(desktop.active_window())
            elif self.path == "/setup/launched":
                self._json(desktop.launched_applications())
            elif self.path == "/activity":
                self._json(desktop.activity())
            elif self.path == "/setup/report":
                self._json(desktop.setup_report())
            elif self.path == "/health":
                self._json({"ok": True, "display": desktop.display, "pid": os.getpid(),
                            "incidents": list(desktop.incidents)})
            else:
                raise RequestError(404, f"no endpoint {_safe(self.path)}")

        def _post(self) -> None:
            if self.path == "/setup/upload":
                fields = _multipart(self.headers.get("Content-Type", ""), self._raw(MAX_UPLOAD_BYTES))
                path, data = fields.get("file_path"), fields.get("file_data")
                if not isinstance(path, bytes) or not path or data is None:
                    raise RequestError(400, "/setup/upload takes multipart fields file_path and file_data")
                try:
                    desktop.upload(_path(path.decode(errors="replace")), data)
                except RequestError as e:
                    desktop.note_setup("upload", path.decode(errors="replace"), str(e))
                    raise
                desktop.note_setup("upload", path.decode(errors="replace"))
                self._json({"status": "success"})
                return
            body = self._body()
            if self.path in POSTS_AS_GETS:
                self._get()
            elif self.path == "/desktop_path":
                self._json({"desktop_path": str(desktop.home / "Desktop")})
            elif self.path == "/wallpaper":
                if desktop.wallpaper is None or (data := desktop.read_file(desktop.wallpaper)) is None:
                    raise RequestError(404, "no wallpaper is set")
                self._send(200, data, "application/octet-stream")
            elif self.path == "/setup/change_wallpaper":
                path = _path(body.get("path"))
                if not desktop.exists(path, "f"):
                    desktop.note_setup("change_wallpaper", path, "the file does not exist")
                    raise RequestError(404, f"{_safe(path)} does not exist")
                desktop.note_setup("change_wallpaper", path)
                desktop.wallpaper = path  # served back by /wallpaper; not painted on the root window
                self._json({"status": "success"})
            elif self.path == "/setup/open_file":
                path = _path(body.get("path"))
                if not desktop.exists(path):
                    desktop.note_setup("open", path, "the file does not exist")
                    raise RequestError(404, f"{_safe(path)} does not exist")
                title = desktop.open_file(path, _number(body, "timeout", OPEN_TIMEOUT_S, 0, 1800))
                desktop.note_setup("open", path, None if title else "no window naming the file appeared")
                self._json({"status": "success", "window": title})
            elif self.path in ("/setup/activate_window", "/setup/close_window"):
                name = body.get("window_name")
                if not isinstance(name, str) or not name:
                    raise RequestError(400, "window_name must be a non-empty string")
                action = "activate" if self.path.endswith("activate_window") else "close"
                titles = desktop.window_action(name, _truthy(body.get("strict")), _truthy(body.get("by_class")), action)
                desktop.note_setup(f"{action}_window", name, None if titles else f"no window matched {name!r}")
                self._json({"status": "success", "windows": titles})
            elif self.path == "/window_size":
                name = body.get("app_class_name")
                if not isinstance(name, str) or not name:
                    raise RequestError(400, "app_class_name must be a non-empty string")
                size = desktop.window_size(name)
                if size is None:
                    raise RequestError(404, f"no window of class {_safe(name)}")
                self._json(size)
            elif self.path == "/list_directory":
                self._json({"directory_tree": desktop.directory_tree(_path(body.get("path")))})
            elif self.path == "/setup/execute_with_verification":
                verification = body.get("verification") or {}
                if not isinstance(verification, dict):
                    raise RequestError(400, "verification must be an object")
                try:
                    self._json(desktop.execute_with_verification(
                        _command(body), _truthy(body.get("shell")), verification,
                        _number(body, "max_wait_time", 10, 0, 600), _number(body, "check_interval", 1, 0.05, 60)))
                except RequestError as e:
                    desktop.note_setup("execute_with_verification", _command(body), str(e))
                    raise
                desktop.note_setup("execute_with_verification", _command(body))
            elif self.path == "/start_recording":
                desktop.start_recording()
                self._json({"status": "success"})
            elif self.path == "/end_recording":
                self._send(200, desktop.end_recording(), "video/mp4")
            elif self.path in ("/run_python", "/run_bash_script"):
                raise RequestError(403, f"{self.path} runs an agent's code unchecked: refused (agent actions go "
                                        "through /run_action)")
            elif self.path in ("/execute", "/setup/execute"):
                command = _command(body)
                timeout = _number(body, "timeout", EXECUTE_TIMEOUT_S, 1, 3600)
                done = desktop.run(command, _truthy(body.get("shell")), timeout)
                desktop.note_setup("execute", command, _execute_failure(command, done))
                self._json(done)
            elif self.path == "/setup/launch":
                command = _command(body)
                try:
                    desktop.launch(command, _truthy(body.get("shell")))
                except OSError as e:
                    desktop.note_setup("launch", command, f"cannot launch: {e}")
                    raise RequestError(500, f"cannot launch {command!r}: {e}") from None
                self._json({"status": "success"})
            elif self.path == "/file":
                name = body.get("file_path")
                if not isinstance(name, str) or not name or "\0" in name:
                    raise RequestError(400, "file_path must be a non-empty string")
                data = desktop.read_file(name)
                if data is None:
                    raise RequestError(404, f"{_safe(name)} does not exist")
                self._send(200, data, "application/octet-stream")
            elif self.path == "/path_info":
                paths = body.get("paths")
                if not isinstance(paths, list) or not paths or len(paths) > 256 or \
                        not all(isinstance(p, str) and p and "\0" not in p for p in paths):
                    raise RequestError(400, "paths must be a list of 1 to 256 non-empty strings")
                self._json({"info": desktop.path_info(paths)})
            elif self.path == "/run_action":
                code = body.get("code", "")
                try:
                    check_action_code(code, desktop.screen)
                except UnsafeCodeError as e:
                    self._json({"status": "refused", "error": _safe(str(e)), "returncode": -1}, 403)
                    return
                done = desktop.run_action(code, action_cpu_s)
                if desktop.incidents:
                    done["incidents"] = list(desktop.incidents)
                self._json(done)
            elif self.path == "/setup/begin":
                desktop.begin_setup()
                self._json({"status": "success"})
            elif self.path == "/session/reset":
                with desktop.reset_lock:
                    ended = desktop.end_applications()
                    desktop.fresh_home()
                    desktop.start_buses()
                    desktop.start_session()
                self._json({"status": "success", "ended": ended})
            elif self.path == "/shutdown":
                self._json({"status": "success"})
                stop.set()
            else:
                raise RequestError(404, f"no endpoint {_safe(self.path)}")

    return Handler


def _truthy(value: Any) -> bool:
    """OSWorld's task files give `shell` as true, false or the string "true"."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise RequestError(400, "path must be a non-empty string")
    return value


def _multipart(content_type: str, raw: bytes) -> dict[str, bytes]:
    """The fields of a multipart/form-data body (OSWorld's /setup/upload: file_path, file_data)."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise RequestError(400, f"expected multipart/form-data, got {_safe(kind.strip()) or 'no Content-Type'}")
    boundary = next((p.split("=", 1)[1].strip().strip('"') for p in params.split(";")
                     if p.strip().lower().startswith("boundary=")), "")
    if not boundary:
        raise RequestError(400, "multipart body without a boundary")
    fields: dict[str, bytes] = {}
    for part in raw.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            raise RequestError(400, "malformed multipart part")
        name = None
        for line in head.decode(errors="replace").split("\r\n"):
            if line.lower().startswith("content-disposition:"):
                for item in line.split(";")[1:]:
                    key, _, val = item.strip().partition("=")
                    if key.lower() == "name":
                        name = val.strip('"')
        if name is not None:
            fields[name] = value[:-2] if value.endswith(b"\r\n") else value
    return fields


def _splice(a: socket.socket, b: socket.socket) -> None:
    splice(a, b)
    b.close()


def _command(body: dict[str, Any]) -> list[str] | str:
    command = body.get("command")
    if isinstance(command, str) and command and "\0" not in command:
        return command
    if isinstance(command, list) and command and all(isinstance(c, str) and "\0" not in c for c in command):
        return command
    raise RequestError(400, "command must be a non-empty string or list of strings")


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{key} must be a number in [{low}, {high}]")
    return float(value)


def _float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _safe(text: str) -> str:
    """Text that survives JSON encoding and logs (lone surrogates replaced), at most 500 chars."""
    return text.encode("utf-8", "replace").decode("utf-8")[:500]


def _no_dump() -> None:
    """Make this process undumpable: other processes of the same uid can no longer read its memory,
    open its /proc files or take its descriptors (the listening socket among them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_DUMPABLE = 4
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _die_with_parent() -> None:
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


def main(argv: list[str] | None = None) -> int:
    global HOST_PID_NAMESPACE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen-fd", type=int, required=True, help="listening Unix socket handed over by the host")
    parser.add_argument("--screen", default="1920x1080")
    parser.add_argument("--display", default=None, help="X display (default: the first free one)")
    parser.add_argument("--home", default=os.environ.get("HOME", "/home/user"))
    parser.add_argument("--runtime-dir", default="/tmp/runtime")
    parser.add_argument("--log-dir", default="/tmp/launched", help="where launched applications' output goes")
    parser.add_argument("--die-with-parent", action="store_true", help="user mode: end when the host process ends")
    parser.add_argument("--wm", default="openbox", help="window manager command ('' for none)")
    parser.add_argument("--limits", default="{}", help="JSON: confinement.Limits fields")
    parser.add_argument("--python-path", default="[]", help="JSON list: site directories for the actions' interpreter")
    parser.add_argument("--agent-uid", type=int, default=None, help="user mode: the agent's uid")
    parser.add_argument("--agent-gid", type=int, default=None, help="user mode: the agent's gid")
    parser.add_argument("--host-pid-namespace", default=None)
    parser.add_argument("--bin-dir", default=None, help="directory of the `python` shim, first on the PATH")
    parser.add_argument("--a11y-missing", default="not asked for (--a11y-missing '' serves it)",
                        help="why the accessibility tree cannot be served here ('': it can)")
    args = parser.parse_args(argv)
    HOST_PID_NAMESPACE = args.host_pid_namespace
    if args.die_with_parent:
        _die_with_parent()
    _no_dump()
    limits = json.loads(args.limits)
    set_limits(limits)
    width, height = (int(v) for v in args.screen.lower().split("x"))
    agent = (args.agent_uid, args.agent_gid) if args.agent_uid is not None else None
    runtime = Path(args.runtime_dir)
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    if agent is not None:
        os.chown(runtime, *agent)
    desktop = Desktop((width, height), Path(args.home), args.wm or None, runtime_dir=runtime,
                      log_dir=Path(args.log_dir), agent=agent, display=args.display, bin_dir=args.bin_dir,
                      a11y_missing=args.a11y_missing or None)
    desktop.python_path = [str(p) for p in json.loads(args.python_path)]
    stop = threading.Event()
    server = UnixHTTPServer(args.listen_fd, make_handler(desktop, stop, limits["action_cpu_s"]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Thread(target=desktop.watch, args=(limits["pids"], limits["total_memory_mib"], stop), daemon=True).start()
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    desktop.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
