"""How training processes on other nodes reach the model servers rank 0 started on loopback.

A server the trainer keeps on its weights (`serve.weight_sync`) must listen on 127.0.0.1: the
development endpoints the weight sync uses (/collective_rpc, /pause, /init_weight_transfer_engine)
are not guarded by vLLM's API key, and /collective_rpc runs worker methods by name. When a run
spans several nodes, the ranks there still need the server's OpenAI API, so rank 0 opens a
`Gateway` per server on an address they reach and announces its URL instead of the server's: the
gateway passes on only `/v1/...` requests that carry the run's API key, and nothing else.

`announce_host` says which address that is: `serve.announce_host`, else torchrun's MASTER_ADDR
(the other ranks already reach rank 0's node there: it hosts the process group's store). Under
c10d rendezvous MASTER_ADDR is rank 0's own host name (`socket.getfqdn()`), which /etc/hosts often
maps to a loopback address on that node (Debian's 127.0.1.1) while the other nodes resolve it to the
node's network address: a gateway for this node's own name listens on every interface then.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Mapping

from arpo_lib.agent.client import ServerError
from arpo_lib.run.net import is_loopback, weak_key_reason

FORWARDED_PREFIX = "/v1/"
"""The only paths a gateway passes on: the OpenAI API, which the key protects."""


def spans_nodes(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this torchrun job has processes on other nodes (fewer local processes than in all)."""
    world = int(env.get("WORLD_SIZE", 1))
    return int(env.get("LOCAL_WORLD_SIZE", world)) < world


def announce_host(explicit: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """The address other nodes reach this one at: `explicit` (serve.announce_host), else
    MASTER_ADDR. Loopback is refused: another node would reach itself there."""
    host = explicit or env.get("MASTER_ADDR")
    if not host:
        raise ServerError("a run over several nodes must announce its servers at an address the other nodes "
                          "reach: set serve.announce_host (this node's address), or start it with torchrun, "
                          "which sets MASTER_ADDR")
    if is_loopback(host) or _unspecified(host):
        raise ServerError(f"{host!r} cannot be reached from other nodes: set serve.announce_host to this node's "
                          "address on the network the nodes share (or MASTER_ADDR to that address)")
    return host


def own_host_name(host: str) -> bool:
    """Whether `host` is this machine's own name, short or qualified (`socket.gethostname()`,
    `socket.getfqdn()`: what c10d rendezvous hands the ranks as MASTER_ADDR)."""
    names = {n.lower() for n in (socket.gethostname(), socket.getfqdn()) if n}
    names |= {n.split(".", 1)[0] for n in names}
    return host.lower().rstrip(".") in names - {"localhost"}


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def reachable_url(url: str, host: str) -> str:
    """`url` with an unspecified bind address (0.0.0.0, ::), which means "this machine" only to
    this machine, replaced by `host`."""
    parts = urllib.parse.urlsplit(url)
    if not _unspecified(parts.hostname or ""):
        return url
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class Forward(BaseHTTPRequestHandler):
    """A gateway's answer to one request: passed on to its server (`self.server.gateway`) when it
    asks for `/v1/...` with the key, refused otherwise."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self._forward()

    def do_POST(self):  # noqa: N802
        self._forward()

    def _forward(self) -> None:
        gateway = self.server.gateway
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self.path.startswith(FORWARDED_PREFIX):
            return self._answer(404, {"error": {"message": f"{self.path} is not forwarded"}})
        scheme, _, sent = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(hashlib.sha256(sent.encode()).digest(),
                                                                    gateway.key_digest):
            return self._answer(401, {"error": {"message": "Unauthorized"}})
        headers = {k: v for k in ("Content-Type", "Authorization") if (v := self.headers.get(k))}
        request = urllib.request.Request(gateway.upstream + self.path, method=self.command, headers=headers,
                                         data=body if self.command == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=gateway.timeout_s) as resp:
                self._answer(resp.status, resp.read(), resp.headers.get("Content-Type"))
        except urllib.error.HTTPError as exc:  # the server's own answer (a 400, a 503) goes back as it is
            self._answer(exc.code, exc.read(), exc.headers.get("Content-Type"))
        except OSError as exc:
            self._answer(502, {"error": {"message": f"the server behind the gateway: {exc}"}})

    def _answer(self, status: int, payload: bytes | dict, content_type: str | None = None) -> None:
        raw = json.dumps(payload).encode() if isinstance(payload, dict) else payload
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:
        pass


class Gateway:
    """An HTTP listener on `host` that forwards `/v1/...` requests bearing `api_key` to the server
    at `upstream` (its root URL, e.g. http://127.0.0.1:8000) and answers 404 to any other path.
    The key goes on to the server, which checks it again. Runs in daemon threads until `close()`.

    Args:
        upstream: the server's root URL.
        host: the address to listen on (reachable from the other nodes); this node's own host name
            listens on every interface where it resolves to loopback here (`own_host_name`).
        api_key: the key clients send (`rollout.api_key_env`, else `serve.api_key_env`).
        port: 0 picks a free one.
        timeout_s: how long a forwarded request may take (a long generation).
    """

    def __init__(self, upstream: str, host: str, api_key: str | None, *, port: int = 0, timeout_s: float = 3600.0):
        if not api_key:
            raise ServerError(f"the gateway on {host} would open the model server to the network without a key: "
                              "set serve.api_key_env (the NAME of a variable holding one) for a run over several nodes")
        if weak := weak_key_reason(api_key, host):
            raise ServerError(weak)
        self.upstream, self.timeout_s = upstream.rstrip("/"), timeout_s
        self.key_digest = hashlib.sha256(api_key.encode()).digest()
        try:
            family, _, _, _, (address, *_) = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            if is_loopback(address):  # e.g. a host name that /etc/hosts maps to 127.0.1.1 here
                if not own_host_name(host):
                    raise ServerError(f"{host!r} is {address} on this node, which other nodes cannot reach: set "
                                      "serve.announce_host to this node's address on the network the nodes share")
                # the other nodes resolve this node's name to its network address: listen there too
                address = "::" if family == socket.AF_INET6 else "0.0.0.0"
            server_class = type("GatewayServer", (ThreadingHTTPServer,), {"address_family": family,
                                                                          "daemon_threads": True, "gateway": self})
            self._server = server_class((address, port), Forward)
        except OSError as exc:
            raise ServerError(f"could not listen on {host}:{port} for the other nodes ({exc}): set "
                              "serve.announce_host to an address of this node") from exc
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="arpo-gateway", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        """What the other nodes' clients take as base_url."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
