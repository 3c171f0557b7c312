"""Servers of a run over several nodes (arpo_lib/serving/gateway.py): what rank 0 announces is
reachable from another host, here a network namespace joined to this machine by a veth pair, and
leads only to the OpenAI API of a server that stays on loopback (its weight-sync endpoints do not)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from arpo_lib.agent.client import ServerError
from arpo_lib.run.net import is_loopback
from arpo_lib.serving.gateway import Gateway, announce_host, reachable_url, spans_nodes
from arpo_lib.serving.weight_sync import ServedPolicy
from tests.netns import NamespaceUnavailable, veth_namespace

KEY = "k" * 32


def test_a_run_spans_nodes_when_fewer_processes_are_local_than_in_all():
    assert not spans_nodes({})
    assert not spans_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert spans_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})


def test_the_announced_host_is_the_option_else_master_addr_never_loopback():
    assert announce_host(None, {"MASTER_ADDR": "node0"}) == "node0"
    assert announce_host("10.0.0.5", {"MASTER_ADDR": "node0"}) == "10.0.0.5"
    for bad in ({"MASTER_ADDR": "127.0.0.1"}, {"MASTER_ADDR": "localhost"}, {"MASTER_ADDR": "0.0.0.0"}, {}):
        with pytest.raises(ServerError, match="serve.announce_host"):
            announce_host(None, bad)
    assert reachable_url("http://0.0.0.0:8000/v1", "10.0.0.5") == "http://10.0.0.5:8000/v1"
    assert reachable_url("http://node3:8000/v1", "10.0.0.5") == "http://node3:8000/v1"


def test_a_gateway_needs_a_key_that_can_protect_it():
    with pytest.raises(ServerError, match="serve.api_key_env"):
        Gateway("http://127.0.0.1:1", "10.0.0.5", None)
    with pytest.raises(ServerError, match="at least"):
        Gateway("http://127.0.0.1:1", "10.0.0.5", "empty")
    with pytest.raises(ValueError, match="api_key_env"):
        ServedPolicy(connect=_Client, save_weights=str, sync="none", url="http://127.0.0.1:1/v1",
                     announce_host="10.0.0.5")


class _Client:
    def __init__(self, url):
        self.base_url = url
        self.requests = self.prompt_mismatches = self.inexact = 0

    @property
    def base_urls(self):
        return [self.base_url]

    def close(self):
        pass


class _Upstream(BaseHTTPRequestHandler):
    """A model server on loopback: its OpenAI API wants the key; /collective_rpc does not."""

    def _serve(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/v1/") and self.headers.get("Authorization") != f"Bearer {KEY}":
            status, answer = 401, {"error": "Unauthorized"}
        else:
            status, answer = 200, {"path": self.path, "method": self.command, "body": body.decode()}
        raw = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = _serve

    def log_message(self, *args):
        pass


@pytest.fixture
def other_host():
    """(this machine's address as the other host sees it, a function running Python there)."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        with veth_namespace(ip, "gw") as (ns, net):
            def there(code: str) -> str:
                done = subprocess.run([ip, "netns", "exec", ns, sys.executable, "-c", textwrap.dedent(code)],
                                      capture_output=True, text=True, timeout=30)
                assert done.returncode == 0, done.stderr
                return done.stdout.strip()

            yield f"{net}.1", there
    except NamespaceUnavailable as exc:
        pytest.skip(str(exc))


_FETCH = """\
import json, sys, urllib.error, urllib.request
def fetch(url, key=None, data=None):
    headers = {{"Authorization": "Bearer " + key}} if key else {{}}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=5) as r:
            return [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        return [e.code, None]
    except OSError as e:
        return ["unreachable", str(e)]
print(json.dumps([{calls}]))
"""


def test_the_announced_url_reaches_the_servers_api_from_another_host_and_nothing_else(other_host):
    this_host, there = other_host
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    server_url = f"http://127.0.0.1:{upstream.server_port}/v1"
    served = ServedPolicy(connect=_Client, save_weights=str, sync="none", url=server_url,
                          announce_host=this_host, api_key=KEY)
    try:
        assert served.policy(0).base_url == server_url  # rank 0 itself stays on loopback
        (announced,) = served.urls
        parts = urllib.parse.urlsplit(announced)
        assert parts.hostname == this_host and not is_loopback(parts.hostname)
        root = f"http://{parts.netloc}"
        calls = (f'fetch("{announced}/models", "{KEY}"), fetch("{announced}/chat/completions", "{KEY}", b"{{}}"), '
                 f'fetch("{announced}/models"), fetch("{announced}/models", "wrong"), '
                 f'fetch("{root}/collective_rpc", "{KEY}", b"{{}}"), '
                 f'fetch("http://{this_host}:{upstream.server_port}/v1/models", "{KEY}")')
        models, chat, keyless, wrong, rpc, direct = json.loads(there(_FETCH.format(calls=calls)))
        assert models == [200, {"path": "/v1/models", "method": "GET", "body": ""}]
        assert chat == [200, {"path": "/v1/chat/completions", "method": "POST", "body": "{}"}]
        assert keyless[0] == wrong[0] == 401 and rpc[0] == 404  # the weight-sync endpoints stay private
        assert direct[0] == "unreachable"  # the server itself is on loopback only
        assert served.urls == [announced]  # one gateway per server, kept while it runs
    finally:
        served.close()
        upstream.shutdown()
        upstream.server_close()
    (gone,) = json.loads(there(_FETCH.format(calls=f'fetch("{announced}/models", "{KEY}")')))
    assert gone[0] == "unreachable"


def test_a_trainer_over_several_nodes_announces_through_a_gateway_or_says_what_is_missing(monkeypatch):
    """build.served_policy on rank 0 of a torchrun job with a second node."""
    from types import SimpleNamespace

    from arpo_lib import build
    from arpo_lib.run.config import load_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("ARPO_TEST_GATEWAY_KEY", KEY)
    cfg = load_config("configs/smoke.yaml", ["rollout.backend=server", "serve.backend=vllm", "serve.weight_sync=true",
                                             "rollout.weight_sync=reload"])
    trained = SimpleNamespace(path="models/base")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ServerError, match="serve.announce_host"):
        build.served_policy(cfg, trained, backend=None)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    with pytest.raises(ValueError, match="serve.api_key_env"):
        build.served_policy(cfg, trained, backend=None)
    cfg.serve.api_key_env = "ARPO_TEST_GATEWAY_KEY"
    assert build.served_policy(cfg, trained, backend=None)._announce_host == "10.0.0.5"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node: loopback as before
    assert build.served_policy(cfg, trained, backend=None)._announce_host is None


def test_a_gateway_for_this_nodes_own_name_that_resolves_to_loopback_here_listens_where_others_reach_it(
        other_host, monkeypatch):
    """c10d hands the ranks rank 0's host name as MASTER_ADDR; /etc/hosts on that node often maps it
    to 127.0.1.1 while the other nodes resolve it to the node's network address. The gateway for
    that name listens on every interface, announces the name, and the other host (resolving the name
    as a cluster would) reaches the servers' API through it; a name not this node's own is refused."""
    import socket

    this_host, there = other_host
    name = socket.gethostname()
    resolve = socket.getaddrinfo

    def etc_hosts(host, *args, **kwargs):  # this node's name as Debian's /etc/hosts has it
        if host == name:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", args[0] if args else 0))]
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", etc_hosts)
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    served = ServedPolicy(connect=_Client, save_weights=str, sync="none",
                          url=f"http://127.0.0.1:{upstream.server_port}/v1", announce_host=name, api_key=KEY)
    try:
        served.policy(0)  # rank 0's own client: the gateways open with the fleet
        (announced,) = served.urls
        parts = urllib.parse.urlsplit(announced)
        assert parts.hostname == name
        as_resolved_there = announced.replace(f"//{name}:", f"//{this_host}:")
        calls = f'fetch("{as_resolved_there}/models", "{KEY}"), fetch("{as_resolved_there}/models")'
        models, keyless = json.loads(there(_FETCH.format(calls=calls)))
        assert models == [200, {"path": "/v1/models", "method": "GET", "body": ""}] and keyless[0] == 401
    finally:
        served.close()
        upstream.shutdown()
        upstream.server_close()
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: etc_hosts(name, *a, **k))
    with pytest.raises(ServerError, match="serve.announce_host"):  # another name resolving to loopback here
        Gateway("http://127.0.0.1:1", "not-this-node", KEY)


def test_a_run_over_several_nodes_without_the_servers_key_is_refused_when_its_config_loads(monkeypatch, capsys):
    """Every rank of a torchrun job spanning nodes loads the config first: a run whose rank 0 starts
    servers (weights streamed to them) without a key the gateway can use stops there, naming the
    fix, before a model loads (before: rank 0 failed at the gateway once its model had loaded)."""
    from arpo_lib import build, cli
    from arpo_lib.run.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "12")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.delenv("ARPO_SERVE_API_KEY", raising=False)
    full = "configs/osworld_full128.yaml"
    with pytest.raises(ConfigError, match=r"^serve\.api_key_env: this run spans several nodes.*"
                                          r"set serve\.api_key_env=ARPO_SERVE_API_KEY"):
        build.load_config(full, ["serve.api_key_env=null"])
    with pytest.raises(ConfigError, match="ARPO_SERVE_API_KEY is not set"):
        build.load_config(full)
    monkeypatch.setenv("ARPO_SERVE_API_KEY", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        build.load_config(full)
    monkeypatch.setenv("ARPO_SERVE_API_KEY", KEY)
    assert build.load_config(full).serve.api_key_env == "ARPO_SERVE_API_KEY"
    monkeypatch.delenv("ARPO_SERVE_API_KEY")
    build.load_config(full, ["serve.replicas=1", "serve.cuda_devices=null", "rollout.weight_sync=reload",
                             "rollout.server_url=http://10.0.0.9:8000/v1"])  # servers started elsewhere: no gateway
    monkeypatch.setattr(build, "trainer", lambda *a, **k: pytest.fail("a trainer (and its model) was built"))
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun starts each rank
    assert cli.main(["train", "--config", full, "serve.api_key_env=null"]) == 2
    assert "serve.api_key_env" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "12")  # one node: the servers stay on loopback, no key needed
    assert build.load_config(full, ["serve.api_key_env=null"]).serve.api_key_env is None
