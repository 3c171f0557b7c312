"""Keeping a rollout server on the trainer's weights, on the CPU: the version bookkeeping of
`ServedPolicy`, the reload protocol against a recording HTTP server, and atomic weight saves."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from arpo_lib.agent.client import ServerRequestError
from arpo_lib.serving.weight_sync import ServedPolicy, reload_weights, save_for_server


class _Client:
    def __init__(self, url):
        self.base_url, self.closed = url, False
        self.requests = self.prompt_mismatches = self.inexact = 0

    @property
    def base_urls(self):
        return [self.base_url]

    def close(self):
        self.closed = True


class _Server:
    def __init__(self, n, model_dir):
        self.base_url, self.model_dir, self.stopped = f"http://h:{n}/v1", model_dir, False

    def stop(self):
        self.stopped = True


def _served(sync, url=None, replicas=1, broken=()):
    saves, servers = [], []

    def save():
        saves.append(f"weights-{len(saves)}")
        return saves[-1]

    def start(model_dir, replica):
        if replica in broken:
            raise RuntimeError(f"replica {replica} did not come up")
        servers.append(_Server(len(servers), model_dir))
        return servers[-1]

    served = ServedPolicy(connect=_Client, save_weights=save, sync=sync, url=url,
                          start=None if url else start, initial_model="models/base", replicas=replicas)
    return served, saves, servers


def test_restart_starts_on_the_current_weights_and_restarts_on_new_ones():
    served, saves, servers = _served("restart")
    first = served.policy(1)  # after the warm start: the server starts on those weights
    assert servers[0].model_dir == "weights-0" and served.served_version == 1 and first.base_url == "http://h:0/v1"
    assert served.policy(1) is first and len(saves) == 1  # nothing changed, nothing pushed
    first.requests = 7
    second = served.policy(3)
    assert servers[0].stopped and first.closed and servers[1].model_dir == "weights-1"
    assert second is not first and served.served_version == 3
    second.requests = 2
    assert served.metrics()["server_requests"] == 9 and served.seconds_sync > 0  # totals over the run
    served.close()
    assert servers[1].stopped and second.closed


def test_a_server_started_without_sync_serves_the_initial_model_and_says_so(capsys):
    served, saves, servers = _served("none")
    served.policy(2)
    assert servers[0].model_dir == "models/base" and not saves
    assert "weight_sync=none" in capsys.readouterr().out
    served.policy(5)
    assert len(servers) == 1 and not saves  # never pushed: off-policy on purpose


def test_someone_elses_server_gets_our_weights_before_the_first_rollout(monkeypatch):
    pushed = []
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d: pushed.append((url, d)))
    served, saves, _ = _served("reload", url="http://remote:8000/v1")
    served.policy(0)
    assert pushed == [("http://remote:8000/v1", "weights-0")] and served.served_version == 0
    served.policy(0)
    served.policy(1)
    assert [d for _, d in pushed] == ["weights-0", "weights-1"]


def test_servers_started_elsewhere_are_one_fleet_and_each_gets_our_weights(monkeypatch):
    """rollout.server_url as a list (e.g. one vLLM per node): one client over all, every one
    reloaded with each new version, requests counted per server."""
    pushed = []
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d: pushed.append((url, d)))
    urls = ["http://node0:8000/v1", "http://node1:8000/v1"]
    served, saves, servers = _served("reload", url=urls)
    fleet = served.policy(0)
    assert fleet.base_urls == urls and served.replicas == 2 and not servers
    assert sorted(pushed) == [(u, "weights-0") for u in urls]
    fleet.clients[1].requests = 3
    served.policy(1)
    assert sorted(pushed[2:]) == [(u, "weights-1") for u in urls]
    assert served.metrics()["server_requests_by_replica"] == [0, 3]
    with pytest.raises(ValueError, match="empty"):
        ServedPolicy(connect=_Client, save_weights=str, sync="reload", url=[])


def test_a_fleet_is_started_restarted_and_reloaded_as_a_whole(monkeypatch):
    served, saves, servers = _served("restart", replicas=3)
    fleet = served.policy(1)
    assert fleet.base_urls == ["http://h:0/v1", "http://h:1/v1", "http://h:2/v1"]
    assert [s.model_dir for s in servers] == ["weights-0"] * 3
    fleet.clients[1].requests = 4
    served.policy(2)
    assert all(s.stopped for s in servers[:3]) and [s.model_dir for s in servers[3:]] == ["weights-1"] * 3
    served.client.clients[2].requests = 1
    assert served.metrics()["server_requests_by_replica"] == [0, 4, 1]  # totals over the run
    assert served.metrics()["server_requests"] == 5
    served.close()
    assert all(s.stopped for s in servers)

    pushed = []
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d: pushed.append((url, d)))
    served, saves, servers = _served("reload", replicas=2)
    served.policy(0)
    served.policy(1)
    assert sorted(pushed) == [("http://h:0/v1", "weights-1"), ("http://h:1/v1", "weights-1")]
    assert len(servers) == 2  # reloaded in place, not restarted


def test_a_replica_that_fails_to_start_stops_the_others():
    served, _, servers = _served("restart", replicas=3, broken={1})
    with pytest.raises(RuntimeError, match="replica 1 did not come up"):
        served.policy(0)
    assert len(servers) == 2 and all(s.stopped for s in servers) and served.servers == []


def test_impossible_combinations_are_refused():
    with pytest.raises(ValueError, match="restart"):
        ServedPolicy(connect=_Client, save_weights=str, sync="restart", url="http://h/v1")
    with pytest.raises(ValueError, match="sync"):
        ServedPolicy(connect=_Client, save_weights=str, sync="sometimes", url="http://h/v1")
    with pytest.raises(ValueError, match="replicas"):
        ServedPolicy(connect=_Client, save_weights=str, sync="reload", url="http://h/v1", replicas=2)


class _Recorder(BaseHTTPRequestHandler):
    calls: list = []
    fail_rpc = False

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        type(self).calls.append((self.path, body))
        status = 500 if (self.path == "/collective_rpc" and type(self).fail_rpc) else 200
        payload = json.dumps({"results": [1]} if self.path == "/collective_rpc" else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    _Recorder.calls, _Recorder.fail_rpc = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_reload_pauses_reloads_drops_every_cache_and_resumes(recorder, tmp_path):
    result = reload_weights(recorder + "/v1", tmp_path / "w")
    paths = [p for p, _ in _Recorder.calls]
    assert paths == ["/pause?mode=wait", "/collective_rpc", "/reset_encoder_cache", "/reset_mm_cache",
                     "/reset_prefix_cache", "/resume"]
    rpc = _Recorder.calls[1][1]
    assert rpc == {"method": "arpo_reload_weights", "kwargs": {"weights_path": str((tmp_path / "w").resolve())}}
    assert result["result"] == {"results": [1]} and result["seconds"] >= 0


def test_a_failed_reload_still_resumes_the_server(recorder, tmp_path):
    _Recorder.fail_rpc = True
    with pytest.raises(ServerRequestError, match="500"):
        reload_weights(recorder, tmp_path)
    assert [p for p, _ in _Recorder.calls][-1] == "/resume"


class _Saver:
    def __init__(self):
        self.n = 0

    def save(self, directory):
        self.n += 1
        Path(directory).mkdir(parents=True)
        (Path(directory) / "weights.txt").write_text(str(self.n))


def test_weights_are_replaced_whole(tmp_path):
    policy = _Saver()
    target = tmp_path / "server_weights"
    assert save_for_server(policy, target) == target
    save_for_server(policy, target)
    assert (target / "weights.txt").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_weights"]
