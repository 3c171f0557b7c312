"""The action server that runs INSIDE a desktop sandbox (see sandbox.py): it starts the X server
and the window manager, then answers HTTP on a Unix socket the host shares with the sandbox.

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
    POST /run_action            {"code"}: agent actions; only code `check_action_code` accepts runs
    GET  /active_window         {"id", "name", "x", "y", "width", "height"} of the focused window
    POST /session/reset         end every application, re-create the home directory empty
    POST /shutdown

Only the Python standard library, Pillow and the command-line tools of the sandbox are used here:
the server starts in well under a second and never imports torch.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ACTION_TIMEOUT_S = 60.0
"""One agent action (a pyautogui snippet) may take this long; OSWorld's server allows 120 s."""
EXECUTE_TIMEOUT_S = 120.0
"""Default limit of a trusted /execute command."""
HOME_DIRS = ("Desktop", "Documents", "Downloads")
"""Created in every fresh home directory."""
LAUNCH_LOGS = Path("/tmp/launched")
"""stdout+stderr of each launched application (the sandbox's own /tmp), emptied at every reset."""
LAUNCH_OUTPUT_CHARS = 2000
"""How much of an application's output /setup/launched returns (the end of it)."""


class UnixHTTPServer(ThreadingHTTPServer):
    address_family = socket.AF_UNIX
    daemon_threads = True

    def server_bind(self) -> None:  # HTTPServer's bind looks up a host name: not for a path
        self.socket.bind(self.server_address)
        self.server_name, self.server_port = "sandbox", 0


class Desktop:
    """The X server, the window manager and every application started for the agent."""

    def __init__(self, display: str, screen: tuple[int, int], home: Path, wm: str | None) -> None:
        self.display, self.screen, self.home = display, screen, home
        self.env = {**os.environ, "DISPLAY": display, "HOME": str(home), "NO_AT_BRIDGE": "1",
                    "XDG_RUNTIME_DIR": "/tmp/runtime", "PYTHONDONTWRITEBYTECODE": "1"}
        Path("/tmp/runtime").mkdir(mode=0o700, exist_ok=True)
        number = display.lstrip(":")
        self.xvfb = subprocess.Popen(
            ["Xvfb", display, "-screen", "0", f"{screen[0]}x{screen[1]}x24", "-nolisten", "tcp", "-noreset"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not Path(f"/tmp/.X11-unix/X{number}").exists():
            if self.xvfb.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Xvfb {display} did not start (exit {self.xvfb.poll()})")
            time.sleep(0.05)
        self.wm = subprocess.Popen([wm], env=self.env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL) if wm else None
        if self.wm is not None:
            self._wait_for_window_manager(deadline=time.monotonic() + 30)
        self.keep = {os.getpid(), self.xvfb.pid} | ({self.wm.pid} if self.wm else set())
        self.launched: list[subprocess.Popen] = []
        """Applications started by /setup/launch, reaped once they end."""
        self.launch_records: list[tuple[Any, subprocess.Popen, Path]] = []
        """(command, process, output log) of every application launched since the last reset."""
        self.fresh_home()

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

    def fresh_home(self) -> None:
        for child in self.home.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        for name in HOME_DIRS:
            (self.home / name).mkdir(exist_ok=True)
        self.launch_records = []
        shutil.rmtree(LAUNCH_LOGS, ignore_errors=True)

    def end_applications(self) -> int:
        """SIGKILL every process of the sandbox but the server, the X server, the window manager
        and the sandbox's init (pid 1); returns how many were ended."""
        ended = 0
        for pid in self._others():
            try:
                os.kill(pid, signal.SIGKILL)
                ended += 1
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in self._others()):
            time.sleep(0.05)
        self.launched = [p for p in self.launched if p.poll() is None]  # reap the ended
        return ended

    def _others(self) -> list[int]:
        return [pid for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
                if pid not in self.keep and pid != 1]

    def screenshot_png(self) -> bytes:
        from PIL import ImageGrab

        image = ImageGrab.grab(xdisplay=self.display)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    def run(self, command: list[str] | str, shell: bool, timeout: float) -> dict[str, Any]:
        try:
            done = subprocess.run(command, shell=shell, env=self.env, cwd=self.home, capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            return {"status": "error", "output": _text(e.stdout), "error": f"timed out after {timeout:.0f} s",
                    "returncode": -1}
        except OSError as e:
            return {"status": "error", "output": "", "error": str(e), "returncode": -1}
        return {"status": "success" if done.returncode == 0 else "error", "output": done.stdout,
                "error": done.stderr, "returncode": done.returncode}

    def launch(self, command: list[str] | str, shell: bool) -> None:
        """Start an application and return; its output goes to a log that `launched` reads, so a
        window that never appears can be explained (a crash, a missing library, a bad argument)."""
        self.launched = [p for p in self.launched if p.poll() is None]
        LAUNCH_LOGS.mkdir(parents=True, exist_ok=True)
        log_path = LAUNCH_LOGS / f"{len(self.launch_records)}.log"
        with open(log_path, "wb") as log:  # OSError (e.g. no such program) goes to the caller: HTTP 500
            process = subprocess.Popen(command, shell=shell, env=self.env, cwd=self.home, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


def make_handler(desktop: Desktop, stop: threading.Event) -> type[BaseHTTPRequestHandler]:
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

        def _body(self) -> dict[str, Any]:
            """JSON, or a form (OSWorld's controller posts /file as form field `file_path`)."""
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
                return {k: v[-1] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
            return json.loads(raw or b"{}")

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/screenshot":
                self._send(200, desktop.screenshot_png(), "image/png")
            elif self.path == "/screen_size":
                self._json({"width": desktop.screen[0], "height": desktop.screen[1]})
            elif self.path == "/platform":
                self._send(200, b"Linux", "text/plain")
            elif self.path == "/active_window":
                self._json(desktop.active_window())
            elif self.path == "/setup/launched":
                self._json(desktop.launched_applications())
            elif self.path == "/health":
                self._json({"ok": True, "display": desktop.display, "pid": os.getpid()})
            else:
                self._json({"error": f"no endpoint {self.path}"}, 404)

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = self._body()
            except (ValueError, json.JSONDecodeError) as e:
                self._json({"error": f"request body is not JSON: {e}"}, 400)
                return
            if self.path in ("/execute", "/setup/execute"):
                self._json(desktop.run(body["command"], bool(body.get("shell", False)),
                                       float(body.get("timeout", EXECUTE_TIMEOUT_S))))
            elif self.path == "/setup/launch":
                try:
                    desktop.launch(body["command"], bool(body.get("shell", False)))
                except OSError as e:
                    self._json({"status": "error", "error": f"cannot launch {body['command']!r}: {e}"}, 500)
                    return
                self._json({"status": "success"})
            elif self.path == "/file":
                name = str(body["file_path"])
                path = desktop.home / name[2:] if name.startswith("~/") else Path(name)
                if path.is_file():
                    self._send(200, path.read_bytes(), "application/octet-stream")
                else:
                    self._json({"error": f"{path} does not exist"}, 404)
            elif self.path == "/run_action":
                code = str(body.get("code", ""))
                try:
                    check_action_code(code, desktop.screen)
                except UnsafeCodeError as e:
                    self._json({"status": "refused", "error": str(e), "returncode": -1}, 403)
                    return
                prefix = "import pyautogui; pyautogui.FAILSAFE = False; pyautogui.PAUSE = 0.05\n"
                self._json(desktop.run([sys.executable, "-c", prefix + code], False, ACTION_TIMEOUT_S))
            elif self.path == "/session/reset":
                ended = desktop.end_applications()
                desktop.fresh_home()
                self._json({"status": "success", "ended": ended})
            elif self.path == "/shutdown":
                self._json({"status": "success"})
                stop.set()
            else:
                self._json({"error": f"no endpoint {self.path}"}, 404)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="Unix socket path to serve on")
    parser.add_argument("--screen", default="1920x1080")
    parser.add_argument("--display", default=":0")
    parser.add_argument("--home", default=os.environ.get("HOME", "/home/user"))
    parser.add_argument("--wm", default="openbox", help="window manager command ('' for none)")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.screen.lower().split("x"))
    desktop = Desktop(args.display, (width, height), Path(args.home), args.wm or None)
    Path(args.socket).unlink(missing_ok=True)
    stop = threading.Event()
    server = UnixHTTPServer(args.socket, make_handler(desktop, stop))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    desktop.end_applications()
    for proc in (desktop.wm, desktop.xvfb):
        if proc is not None:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
