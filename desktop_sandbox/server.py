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

The server is this file (start-up, the socket), `routes.py` (the route table and the handler),
`session.py` (the desktop each route acts on), `processes.py`, `files.py` and `http_input.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from desktop_sandbox import processes
from desktop_sandbox.processes import die_with_parent, no_dump, set_limits
from desktop_sandbox.routes import make_handler
from desktop_sandbox.session import Desktop
from desktop_sandbox.sudo import BrokerChannel



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


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--keep-pid", type=int, action="append", default=[],
                        help="a process of the sandbox that is not the episode's (with root inside: the sudo broker)")
    parser.add_argument("--broker-fd", type=int, default=None,
                        help="with root inside: this server's channel to the root broker (sudo.BrokerChannel)")
    args = parser.parse_args(argv)
    processes.HOST_PID_NAMESPACE = args.host_pid_namespace
    if args.die_with_parent:
        die_with_parent()
    no_dump()
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
    desktop.keep.update(args.keep_pid)  # a reset and the limits' watcher leave it alone
    if args.broker_fd is not None:  # root's processes, which this server may not signal, are ended through it
        desktop.root_broker = BrokerChannel(args.broker_fd)
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
