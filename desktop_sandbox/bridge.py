"""Loopback TCP ports on the host that lead into one desktop sandbox.

OSWorld's own code (`desktop_env`: PythonController, SetupController, the getters) speaks HTTP to
`ip:server_port`, Chrome's DevTools protocol to `ip:chromium_port` and VLC's web interface to
`ip:vlc_port`. The sandbox has no network of its own and its action server listens on a Unix
socket only the host can open; `LoopbackBridge` gives each of those a port on 127.0.0.1:

    server    bytes copied to and from the action server's socket (it speaks OSWorld's API)
    chromium  a CONNECT tunnel through the server to 127.0.0.1:9222 inside the sandbox
    vlc       a CONNECT tunnel to 127.0.0.1:8080 inside

The ports are on the host's loopback, so the agent (in its own network namespace) cannot reach
them. The host's other users could (OSWorld's Docker provider publishes its VM's ports to all of
them), so a connection is served only when the kernel's socket table says its other end belongs
to this process's user or to root (`peer_uid`): on a shared machine (a cluster node, a lab server)
another account cannot run code in the sandbox through the server's `/execute` and so change what
its checkers score; nor can the agent of a `user`-fallback sandbox, which runs as its own account
on the host's network, where iptables is missing.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
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
        self._refused = 0
        self.allowed_uids = {os.geteuid(), 0}
        """Whose connections are served: this process's user and root (who can read it anyway)."""
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
            uid = peer_uid(client)
            if uid not in self.allowed_uids:
                if not self._refused:
                    log.warning("bridge: refused a connection from %s (uid %s): only uid(s) %s may reach the "
                                "sandbox", client.getpeername(), uid, sorted(self.allowed_uids))
                self._refused += 1
                client.close()
                continue
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


def peer_uid(conn: socket.socket) -> int | None:
    """The user owning the other end of an accepted loopback TCP connection, from the kernel's table
    (/proc/net/tcp, tcp6): the row whose local address is `conn`'s peer and whose remote address is
    `conn`'s own, with a live socket (inode not 0). None when there is no such row: a client that
    already closed its end (its row keeps no owner then, so "send, then close at once" is refused
    too), a peer on another machine, or no /proc."""
    try:
        peer, own = conn.getpeername(), conn.getsockname()
    except OSError:
        return None
    table = "/proc/net/tcp6" if conn.family == socket.AF_INET6 else "/proc/net/tcp"
    want = (_proc_address(conn.family, peer), _proc_address(conn.family, own))
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 9 and (fields[1], fields[2]) == want and fields[9] != "0":
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


def _proc_address(family: int, address: tuple) -> str:
    """An (ip, port) as /proc/net/tcp writes it: the address's 32-bit words in the kernel's (little-
    endian) byte order, in hex, then the port."""
    packed = socket.inet_pton(family, address[0])
    words = struct.unpack(f"<{len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{address[1]:04X}"


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
