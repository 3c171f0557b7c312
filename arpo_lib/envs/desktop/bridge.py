"""Loopback TCP ports on the host that lead into one desktop sandbox.

OSWorld's own code (`desktop_env`: PythonController, SetupController, the getters) speaks HTTP to
`ip:server_port`, Chrome's DevTools protocol to `ip:chromium_port` and VLC's web interface to
`ip:vlc_port`. The sandbox has no network of its own and its action server listens on a Unix
socket only the host can open; `LoopbackBridge` gives each of those a port on 127.0.0.1:

    server    bytes copied to and from the action server's socket (it speaks OSWorld's API)
    chromium  a CONNECT tunnel through the server to 127.0.0.1:9222 inside the sandbox
    vlc       a CONNECT tunnel to 127.0.0.1:8080 inside

The ports are on the host's loopback, so the agent (in its own network namespace) cannot reach
them; what the host's own users can reach is what OSWorld's Docker provider publishes too.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

TUNNELS = {"chromium": (9222, 1337), "vlc": (8080,)}
"""Bridge name -> the ports inside the sandbox it tunnels to, the first that answers. OSWorld's
tasks start Chrome with DevTools on 1337 and `socat` from 9222 to it; without socat in the
sandbox, 1337 itself is reached."""


class LoopbackBridge:
    """127.0.0.1 ports into the sandbox whose action server listens at `socket_path`. `ports`
    maps "server", "chromium" and "vlc" to the host ports (chosen free unless given)."""

    def __init__(self, socket_path: str, host: str = "127.0.0.1", ports: dict[str, int] | None = None) -> None:
        self.socket_path, self.host = socket_path, host
        self._listeners: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.ports: dict[str, int] = {}
        try:
            for name, inside in [("server", None), *TUNNELS.items()]:
                listener = socket.create_server((host, (ports or {}).get(name, 0)), reuse_port=False)
                self._listeners.append(listener)
                self.ports[name] = listener.getsockname()[1]
                threading.Thread(target=self._accept, args=(listener, inside), daemon=True,
                                 name=f"bridge-{name}").start()
        except BaseException:
            self.close()
            raise

    def address(self) -> str:
        """OSWorld's provider answer: "ip:server:chromium:vnc:vlc" (no VNC: its port is 0)."""
        return f"{self.host}:{self.ports['server']}:{self.ports['chromium']}:0:{self.ports['vlc']}"

    def _accept(self, listener: socket.socket, inside: tuple[int, ...] | None) -> None:
        while not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(client, inside), daemon=True).start()

    def _carry(self, client: socket.socket, inside: tuple[int, ...] | None) -> None:
        upstream = None
        with self._lock:
            self._open.add(client)
        try:
            for port in inside or (None,):
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(self.socket_path)
                if port is None or _connect_tunnel(upstream, port):
                    break
                upstream.close()
                upstream = None
            if upstream is None:  # nothing answers inside: the client sees the connection closed
                return
            with self._lock:
                self._open.add(upstream)
            splice(client, upstream)
        except OSError as e:
            log.debug("bridge: %s", e)
        finally:
            with self._lock:
                self._open -= {client, upstream}
            for s in (client, upstream):
                if s is not None:
                    s.close()

    def close(self) -> None:
        self._closed.set()
        for listener in self._listeners:
            listener.close()
        with self._lock:
            connections = list(self._open)
        for s in connections:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "LoopbackBridge":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _connect_tunnel(upstream: socket.socket, port: int) -> bool:
    """Ask the action server for a tunnel to `port` inside; True once it answered 200."""
    upstream.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: sandbox\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = upstream.recv(4096)
        if not chunk or len(head) > 65536:
            return False
        head += chunk
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or status[1] != b"200":
        log.debug("bridge: no tunnel to %d: %s", port, head[:300])
        return False
    return True


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have finished (each end's EOF is passed on); the
    caller closes the sockets. Also the action server's CONNECT tunnel (server.py)."""
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    other = threading.Thread(target=pump, args=(b, a), daemon=True)
    other.start()
    pump(a, b)
    other.join()
