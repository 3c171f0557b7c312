"""The action server's endpoints: one route table (`GET` and `POST`: path -> a function of the
request), and the HTTP handler that reads a request, finds its route and answers every failure
as JSON. What each endpoint does: server.py's docstring. Adding an endpoint is one function with
its `@route` line.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler
from collections.abc import Callable
from typing import Any

from desktop_sandbox import a11y, windows
from desktop_sandbox.action_code import UnsafeCodeError, check_action_code
from desktop_sandbox.bridge import splice
from desktop_sandbox.files import MAX_UPLOAD_BYTES, multipart_fields
from desktop_sandbox.http_input import RequestError, as_float, command_field, number_field, path_field, safe, truthy
from desktop_sandbox.processes import EXECUTE_TIMEOUT_S
from desktop_sandbox.session import OPEN_TIMEOUT_S, Desktop, execute_failure


MAX_BODY_BYTES = 8 * 2**20
"""Largest request body accepted (413 above)."""
DRAIN_BYTES = 64 * 2**20
"""A refused body up to this size is read and dropped before the 413 (the client then reads the
answer instead of a reset connection); a larger one gets the 413 and the connection closes."""

TUNNEL_PORTS = frozenset({1337, 9222, 8080})
"""Ports inside the sandbox the host may tunnel to (CONNECT): Chrome's DevTools as OSWorld's tasks
start it (1337, and 9222 where a task runs socat) and VLC's web interface."""
POSTS_AS_GETS = frozenset({"/screen_size", "/cursor_position"})
"""OSWorld's controller POSTs these without a body."""


Answer = Callable[["Request"], None]
GET: dict[str, Answer] = {}
"""Path -> the function that answers a GET of it."""
POST: dict[str, Answer] = {}
"""Path -> the function that answers a POST of it (its body already read: `Request.body`)."""
RAW_POSTS: set[str] = set()
"""POSTs whose function reads the body itself (multipart uploads): not parsed as JSON first."""
QUERY_GETS: set[str] = set()
"""GETs that take a query string (`/accessibility?budget_s=`)."""


def route(method: str, *paths: str, raw: bool = False, query: bool = False) -> Callable[[Answer], Answer]:
    """Register the decorated function as the answer to `method` on each of `paths`."""
    table = {"GET": GET, "POST": POST}[method]

    def register(answer: Answer) -> Answer:
        for path in paths:
            if path in table:
                raise ValueError(f"{method} {path} has two routes")
            table[path] = answer
            if raw:
                RAW_POSTS.add(path)
            if query:
                QUERY_GETS.add(path)
        return answer
    return register


class Request(BaseHTTPRequestHandler):
    """One connection's requests. `desktop`, `stop` and `action_cpu_s` are set on the subclass
    `make_handler` makes for a server."""

    protocol_version = "HTTP/1.1"
    desktop: Desktop
    stop: threading.Event
    action_cpu_s: int
    body: dict[str, Any] = {}

    def address_string(self) -> str:
        return "host"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the host logs what matters
        pass

    def send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def json(self, value: Any, status: int = 200) -> None:
        self.send(status, json.dumps(value).encode(), "application/json")

    def raw(self, limit: int = MAX_BODY_BYTES) -> bytes:
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

    def _parsed_body(self) -> dict[str, Any]:
        """JSON, or a form (OSWorld's controller posts /file as form field `file_path`); a POST
        without a body (OSWorld's /screen_size, /desktop_path, ...) is {}."""
        raw = self.raw()
        try:
            if self.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
                return {k: v[-1] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise RequestError(400, f"request body is not JSON: {type(e).__name__}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    def _guarded(self, answer: Callable[[], None]) -> None:
        """Run one endpoint; every failure becomes a JSON error, never a dropped connection."""
        try:
            answer()
        except RequestError as e:
            self.json({"error": str(e)}, e.status)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 (the server must answer whatever happened)
            try:
                self.json({"error": f"{type(e).__name__}: {safe(str(e))}"}, 500)
            except OSError:
                self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._guarded(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._guarded(self._post)

    def _get(self) -> None:
        answer = GET.get(self.path)
        bare = self.path.split("?", 1)[0]
        if answer is None and bare in QUERY_GETS:
            answer = GET[bare]
        if answer is None:
            raise RequestError(404, f"no endpoint {safe(self.path)}")
        answer(self)

    def _post(self) -> None:
        if self.path in RAW_POSTS:
            POST[self.path](self)
            return
        self.body = self._parsed_body()  # before the lookup: a bad body is a 400 whatever the path
        if self.path in POSTS_AS_GETS:
            self._get()
        elif self.path in POST:
            POST[self.path](self)
        else:
            raise RequestError(404, f"no endpoint {safe(self.path)}")

    def do_CONNECT(self) -> None:  # noqa: N802
        """A tunnel to a port inside the sandbox (Chrome's DevTools, VLC's web interface): the
        host's loopback bridge (bridge.py) carries OSWorld's CDP and VLC clients through it."""
        host, _, port = self.path.rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port.isdigit() or int(port) not in TUNNEL_PORTS:
            self.close_connection = True
            self.json({"error": f"no tunnel to {safe(self.path)} (ports: {sorted(TUNNEL_PORTS)})"}, 403)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
        except OSError as e:
            self.close_connection = True
            self.json({"error": f"nothing answers on port {port} in the sandbox: {e}"}, 502)
            return
        self.send_response(200, "Connection established")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        upstream.settimeout(None)
        splice(self.connection, upstream)
        upstream.close()


def make_handler(desktop: Desktop, stop: threading.Event, action_cpu_s: int) -> type[Request]:
    """The request handler class of one server: the routes above, on `desktop`."""
    return type("Handler", (Request,), {"desktop": desktop, "stop": stop, "action_cpu_s": action_cpu_s})


# ---- what the desktop shows ----------------------------------------------------------------------

@route("GET", "/screenshot")
def _screenshot(r: Request) -> None:
    r.send(200, r.desktop.screenshot_png(), "image/png")


@route("GET", "/screen_size")
def _screen_size(r: Request) -> None:
    r.json({"width": r.desktop.screen[0], "height": r.desktop.screen[1]})


@route("GET", "/windows")
def _windows(r: Request) -> None:
    r.json([w.__dict__ for w in windows.list_windows(r.desktop.display)])


@route("GET", "/cursor_position")
def _cursor_position(r: Request) -> None:
    r.json(list(windows.cursor_position(r.desktop.display)))


@route("GET", "/terminal")
def _terminal(r: Request) -> None:
    r.json({"status": "success", "output": r.desktop.terminal_output()})


@route("GET", "/accessibility", query=True)
def _accessibility(r: Request) -> None:
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(r.path).query)
    budget = number_field({k: as_float(v[-1]) for k, v in query.items()}, "budget_s", a11y.BUDGET_S, 0.5,
                          a11y.MAX_BUDGET_S)
    r.json({"AT": r.desktop.accessibility_tree(budget)})


@route("GET", "/platform")
def _platform(r: Request) -> None:
    r.send(200, b"Linux", "text/plain")


@route("GET", "/active_window")
def _active_window(r: Request) -> None:
    r.json(r.desktop.active_window())


@route("GET", "/setup/launched")
def _launched(r: Request) -> None:
    r.json(r.desktop.launched_applications())


@route("GET", "/activity")
def _activity(r: Request) -> None:
    r.json(r.desktop.activity())


@route("GET", "/setup/report")
def _setup_report(r: Request) -> None:
    r.json(r.desktop.setup_report())


@route("GET", "/health")
def _health(r: Request) -> None:
    r.json({"ok": True, "display": r.desktop.display, "pid": os.getpid(), "incidents": list(r.desktop.incidents)})


@route("POST", "/desktop_path")
def _desktop_path(r: Request) -> None:
    r.json({"desktop_path": str(r.desktop.home / "Desktop")})


@route("POST", "/wallpaper")
def _wallpaper(r: Request) -> None:
    if r.desktop.wallpaper is None or (data := r.desktop.read_file(r.desktop.wallpaper)) is None:
        raise RequestError(404, "no wallpaper is set")
    r.send(200, data, "application/octet-stream")


@route("POST", "/window_size")
def _window_size(r: Request) -> None:
    name = r.body.get("app_class_name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "app_class_name must be a non-empty string")
    size = r.desktop.window_size(name)
    if size is None:
        raise RequestError(404, f"no window of class {safe(name)}")
    r.json(size)


@route("POST", "/list_directory")
def _list_directory(r: Request) -> None:
    r.json({"directory_tree": r.desktop.directory_tree(path_field(r.body.get("path")))})


@route("POST", "/file")
def _file(r: Request) -> None:
    name = r.body.get("file_path")
    if not isinstance(name, str) or not name or "\0" in name:
        raise RequestError(400, "file_path must be a non-empty string")
    data = r.desktop.read_file(name)
    if data is None:
        raise RequestError(404, f"{safe(name)} does not exist")
    r.send(200, data, "application/octet-stream")


@route("POST", "/path_info")
def _path_info(r: Request) -> None:
    paths = r.body.get("paths")
    if not isinstance(paths, list) or not paths or len(paths) > 256 or \
            not all(isinstance(p, str) and p and "\0" not in p for p in paths):
        raise RequestError(400, "paths must be a list of 1 to 256 non-empty strings")
    r.json({"info": r.desktop.path_info(paths)})


@route("POST", "/start_recording")
def _start_recording(r: Request) -> None:
    r.desktop.start_recording()
    r.json({"status": "success"})


@route("POST", "/end_recording")
def _end_recording(r: Request) -> None:
    r.send(200, r.desktop.end_recording(), "video/mp4")


# ---- the task's set-up (trusted: the task file's steps, never the agent's) ------------------------

@route("POST", "/setup/upload", raw=True)
def _upload(r: Request) -> None:
    fields = multipart_fields(r.headers.get("Content-Type", ""), r.raw(MAX_UPLOAD_BYTES))
    path, data = fields.get("file_path"), fields.get("file_data")
    if not isinstance(path, bytes) or not path or data is None:
        raise RequestError(400, "/setup/upload takes multipart fields file_path and file_data")
    try:
        r.desktop.upload(path_field(path.decode(errors="replace")), data)
    except RequestError as e:
        r.desktop.note_setup("upload", path.decode(errors="replace"), str(e))
        raise
    r.desktop.note_setup("upload", path.decode(errors="replace"))
    r.json({"status": "success"})


@route("POST", "/setup/change_wallpaper")
def _change_wallpaper(r: Request) -> None:
    path = path_field(r.body.get("path"))
    if not r.desktop.exists(path, "f"):
        r.desktop.note_setup("change_wallpaper", path, "the file does not exist")
        raise RequestError(404, f"{safe(path)} does not exist")
    r.desktop.note_setup("change_wallpaper", path)
    r.desktop.wallpaper = path  # served back by /wallpaper; not painted on the root window
    r.json({"status": "success"})


@route("POST", "/setup/open_file")
def _open_file(r: Request) -> None:
    path = path_field(r.body.get("path"))
    if not r.desktop.exists(path):
        r.desktop.note_setup("open", path, "the file does not exist")
        raise RequestError(404, f"{safe(path)} does not exist")
    title = r.desktop.open_file(path, number_field(r.body, "timeout", OPEN_TIMEOUT_S, 0, 1800))
    r.desktop.note_setup("open", path, None if title else "no window naming the file appeared")
    r.json({"status": "success", "window": title})


@route("POST", "/setup/activate_window", "/setup/close_window")
def _window_action(r: Request) -> None:
    name = r.body.get("window_name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "window_name must be a non-empty string")
    action = "activate" if r.path.endswith("activate_window") else "close"
    titles = r.desktop.window_action(name, truthy(r.body.get("strict")), truthy(r.body.get("by_class")), action)
    r.desktop.note_setup(f"{action}_window", name, None if titles else f"no window matched {name!r}")
    r.json({"status": "success", "windows": titles})


@route("POST", "/setup/execute_with_verification")
def _execute_with_verification(r: Request) -> None:
    verification = r.body.get("verification") or {}
    if not isinstance(verification, dict):
        raise RequestError(400, "verification must be an object")
    try:
        r.json(r.desktop.execute_with_verification(
            command_field(r.body), truthy(r.body.get("shell")), verification,
            number_field(r.body, "max_wait_time", 10, 0, 600), number_field(r.body, "check_interval", 1, 0.05, 60)))
    except RequestError as e:
        r.desktop.note_setup("execute_with_verification", command_field(r.body), str(e))
        raise
    r.desktop.note_setup("execute_with_verification", command_field(r.body))


@route("POST", "/execute", "/setup/execute")
def _execute(r: Request) -> None:
    command = command_field(r.body)
    timeout = number_field(r.body, "timeout", EXECUTE_TIMEOUT_S, 1, 3600)
    done = r.desktop.run(command, truthy(r.body.get("shell")), timeout)
    r.desktop.note_setup("execute", command, execute_failure(command, done))
    r.json(done)


@route("POST", "/setup/launch")
def _launch(r: Request) -> None:
    command = command_field(r.body)
    try:
        r.desktop.launch(command, truthy(r.body.get("shell")))
    except OSError as e:
        r.desktop.note_setup("launch", command, f"cannot launch: {e}")
        raise RequestError(500, f"cannot launch {command!r}: {e}") from None
    r.json({"status": "success"})


@route("POST", "/setup/begin")
def _setup_begin(r: Request) -> None:
    r.desktop.begin_setup()
    r.json({"status": "success"})


# ---- the agent's actions (checked), the episode, the server ---------------------------------------

@route("POST", "/run_python", "/run_bash_script")
def _unchecked_code(r: Request) -> None:
    raise RequestError(403, f"{r.path} runs an agent's code unchecked: refused (agent actions go through /run_action)")


@route("POST", "/run_action")
def _run_action(r: Request) -> None:
    code = r.body.get("code", "")
    try:
        check_action_code(code, r.desktop.screen)
    except UnsafeCodeError as e:
        r.json({"status": "refused", "error": safe(str(e)), "returncode": -1}, 403)
        return
    done = r.desktop.run_action(code, r.action_cpu_s)
    if r.desktop.incidents:
        done["incidents"] = list(r.desktop.incidents)
    if crashed := r.desktop.crashed_applications():
        done["crashed"] = crashed
    r.json(done)


@route("POST", "/session/reset")
def _session_reset(r: Request) -> None:
    with r.desktop.reset_lock:
        ended = r.desktop.end_applications()
        r.desktop.fresh_home()
        r.desktop.start_buses()
        r.desktop.start_session()
    r.json({"status": "success", "ended": ended})


@route("POST", "/shutdown")
def _shutdown(r: Request) -> None:
    r.json({"status": "success"})
    r.stop.set()
