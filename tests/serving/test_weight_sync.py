"""Keeping a rollout server on the trainer's weights, on the CPU: the version bookkeeping of
`ServedPolicy`, the reload protocol against a recording HTTP server, the streamed push against a
fake vLLM that receives over a real gloo group (honest, stale and corrupting), the checksum both
sides compute, and atomic weight saves. tests/serving/test_vllm.py does the same with vLLM."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from arpo_lib.agent.client import ServerRequestError
import torch

from arpo_lib.serving.vllm_ext import arpo_vllm_ext as ext
from arpo_lib.serving.weight_sync import (ServedPolicy, WeightStream, WeightSyncError, reload_weights,
                                          save_for_server)


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
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d, **kw: pushed.append((url, d)))
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
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d, **kw: pushed.append((url, d)))
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
    monkeypatch.setattr("arpo_lib.serving.weight_sync.reload_weights", lambda url, d, **kw: pushed.append((url, d)))
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
    rpc_result: object = 1

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        type(self).calls.append((self.path, body))
        status = 500 if (self.path == "/collective_rpc" and type(self).fail_rpc) else 200
        answer = {"results": [type(self).rpc_result]} if self.path == "/collective_rpc" else {}
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    _Recorder.calls, _Recorder.fail_rpc, _Recorder.rpc_result = [], False, 1
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
    assert save_for_server(policy.save, target) == target
    save_for_server(policy.save, target)
    assert (target / "weights.txt").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_weights"]


def test_the_reload_checks_the_checksum_of_what_the_server_read(recorder, tmp_path):
    """The extension answers with the checksum of the tensors it read: the trainer's must match."""
    _Recorder.rpc_result = {"refreshed": 0, "checksum": "a" * 64, "tensors": 3}
    reload_weights(recorder, tmp_path, expect="a" * 64)
    with pytest.raises(WeightSyncError, match="not the " + "b" * 64):
        reload_weights(recorder, tmp_path, expect="b" * 64)
    _Recorder.rpc_result = 1  # an extension that says nothing about what it read
    with pytest.raises(WeightSyncError):
        reload_weights(recorder, tmp_path, expect="a" * 64)
    assert [p for p, _ in _Recorder.calls][-1] == "/resume"


# -- the checksum -------------------------------------------------------------------------------

def test_the_checksum_sees_every_bit_the_name_the_dtype_and_the_shape_but_not_the_order(monkeypatch):
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(7)

    def digest(*named):
        d = ext.WeightsDigest()
        for name, t in named:
            d.add(name, t)
        return d.hexdigest()

    base = digest(("a", a), ("b", b))
    assert digest(("b", b), ("a", a)) == base  # order-free: the disk holds them in any order
    flipped = a.clone()
    flipped.view(torch.int16)[1, 2] ^= 1  # one bit of one element
    assert digest(("a", flipped), ("b", b)) != base
    assert digest(("a", a.float()), ("b", b)) != base  # a cast is a different payload
    assert digest(("a", a.reshape(5, 3)), ("b", b)) != base
    assert digest(("x", a), ("b", b)) != base
    # summed in bounded chunks: the same number as all at once
    whole = ext.tensor_bitsum(b)
    monkeypatch.setattr(ext, "_CHUNK", 2)
    assert ext.tensor_bitsum(b) == whole == int(b.view(torch.int32).to(torch.int64).sum())
    # nothing is read back while tensors are added (on a GPU each read is a sync), one read per
    # device when the checksum is asked for
    reads = []
    for method in ("item", "tolist", "__int__"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _real=real, _name=method: (reads.append(_name), _real(self, *a))[1])
    d = ext.WeightsDigest()
    d.add("a", a)
    d.add("b", b)
    assert reads == []
    assert d.hexdigest() == base and reads == ["tolist"]


def test_the_checksum_of_a_saved_directory_is_the_checksum_of_its_tensors(tmp_path):
    from safetensors.torch import save_file

    tensors = {"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(4, dtype=torch.bfloat16)}
    save_file({"w": tensors["w"]}, str(tmp_path / "model-1.safetensors"))
    save_file({"v": tensors["v"]}, str(tmp_path / "model-2.safetensors"))
    d = ext.WeightsDigest()
    for name, t in tensors.items():
        d.add(name, t)
    assert ext.digest_of_directory(tmp_path) == {"checksum": d.hexdigest(), "tensors": 2}


# -- the streamed push, against a fake vLLM that receives over a real gloo group ---------------------

class _FakeVLLM(BaseHTTPRequestHandler):
    """vLLM's weight-transfer endpoints as our engine answers them; `mode` misbehaves on purpose:
    `stale` keeps reporting the version before, `corrupt` loads a tensor with one bit changed."""

    mode = "honest"
    world = 1
    state: dict = {}
    versions: dict = {"torch": "2.9.0+cu128", "nccl": "2.27.3"}
    served = "float32"

    def _send(self, payload):
        raw = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/get_world_size"):
            return self._send({"world_size": type(self).world})
        if self.path == "/weight_info":
            return self._send({"weight_version": self.state.get("weight_version", "default")})
        self.send_error(404)

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        st, path = self.state, self.path
        st.setdefault("calls", []).append(path)
        if path == "/collective_rpc":
            st.setdefault("rpcs", []).append(body["method"])
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            st["group"] = ext.open_group(master_address=info["master_address"], master_port=info["master_port"],
                                         rank=info["rank_offset"], world_size=info["world_size"],
                                         backend=info["backend"], timeout_s=60)
            st["rank"] = info["rank_offset"]
        elif path == "/update_weights":
            info, digest = body["update_info"], ext.WeightsDigest()
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                ext.broadcast(st["group"], t)
                if type(self).mode == "corrupt" and name == info["names"][-1]:
                    t.view(-1).view(ext._INT_VIEW[t.element_size()])[0] ^= 1
                st.setdefault("received", {})[name] = t
                digest.add(name, t)
            version = info["version"] - (1 if type(self).mode == "stale" else 0)
            st["loaded"] = {"version": version, "checksum": digest.hexdigest(), "tensors": digest.count}
        elif path == "/finish_weight_update":
            st["weight_version"] = body["weight_version"]
        elif path == "/collective_rpc" and body["method"] == "arpo_runtime_versions":
            return self._send({"results": [type(self).versions] * type(self).world})
        elif path == "/collective_rpc" and body["method"] == "arpo_serving_dtype":
            return self._send({"results": [type(self).served] * type(self).world})
        elif path == "/collective_rpc":
            assert body["method"] == "arpo_weight_state"
            return self._send({"results": [st.get("loaded", {})]})
        self._send({})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllms():
    """Two fake servers (each with its own handler class and state)."""
    servers = []
    for _ in range(2):
        handler = type("_Fake", (_FakeVLLM,), {"state": {}, "mode": "honest"})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append(server)
    yield [(f"http://127.0.0.1:{s.server_port}/v1", s.RequestHandlerClass) for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


class _Shard:
    """Stands in for an FSDP2 DTensor: metadata without gathering, `full_tensor()` gathers; the
    spy records how many full tensors exist at once."""

    live = peak = 0

    def __init__(self, full):
        self._full, self.shape, self.dtype = full, full.shape, full.dtype

    def full_tensor(self):
        _Shard.live += 1
        _Shard.peak = max(_Shard.peak, _Shard.live)
        out = self._full.clone()
        import weakref
        weakref.finalize(out, lambda: setattr(_Shard, "live", _Shard.live - 1))
        return out


def test_a_streamed_push_reaches_every_server_one_tensor_at_a_time_and_is_confirmed(fake_vllms):
    torch.manual_seed(0)
    params = [("model.embed.weight", _Shard(torch.randn(8, 4))), ("model.norm.weight", _Shard(torch.randn(4))),
              ("lm_head.weight", _Shard(torch.randn(8, 4)))]
    stream = WeightStream([url for url, _ in fake_vllms])
    assert [h.state["rank"] for _, h in fake_vllms] == [1, 2]  # one group: trainer 0, servers 1 and 2
    _Shard.live = _Shard.peak = 0
    result = stream.push(params, 7, torch.bfloat16)
    assert _Shard.peak == 1 and _Shard.live == 0  # never two parameters' full tensors at once
    for _, handler in fake_vllms:
        st = handler.state
        for name, shard in params:
            assert st["received"][name].dtype == torch.bfloat16
            assert torch.equal(st["received"][name], shard._full.to(torch.bfloat16))
        assert st["loaded"] == {"version": 7, "checksum": result["checksum"], "tensors": 3}
        assert st["weight_version"] == "7"
        calls = st["calls"]
        assert calls.index("/pause?mode=wait") < calls.index("/start_weight_update") < calls.index("/update_weights") \
            < calls.index("/finish_weight_update") < calls.index("/reset_prefix_cache") < calls.index("/resume")
    stream.close()


@pytest.mark.parametrize("mode", ["stale", "corrupt"])
def test_a_server_that_does_not_confirm_the_push_stops_the_run(fake_vllms, mode):
    (url, handler), _ = fake_vllms
    handler.mode = mode
    stream = WeightStream([url])
    with pytest.raises(WeightSyncError, match="did not confirm weight version 3"):
        stream.push([("w", torch.randn(5, 3))], 3)
    assert handler.state["calls"][-1] == "/collective_rpc" and "/resume" in handler.state["calls"]


def test_served_policy_streams_each_new_version_and_records_the_checksum(fake_vllms):
    (url, handler), _ = fake_vllms
    weights = {"w": torch.zeros(2, 2)}
    served = ServedPolicy(connect=_Client, save_weights=str, sync="stream", url=url,
                          weights=lambda: list(weights.items()))
    served.policy(0)
    assert handler.state["loaded"]["version"] == 0
    weights["w"] += 1
    served.policy(0)  # nothing changed: nothing sent
    assert handler.state["calls"].count("/update_weights") == 1
    served.policy(1)
    assert torch.equal(handler.state["received"]["w"], torch.ones(2, 2))
    assert served.served_version == 1 and served.last_push["checksum"] == handler.state["loaded"]["checksum"]
    served.close()
    assert handler.state["calls"][-1] == "/shutdown_weight_transfer_engine"
    with pytest.raises(ValueError, match="stream"):
        ServedPolicy(connect=_Client, save_weights=str, sync="stream", url=url)


def test_a_push_sends_the_weights_in_the_dtype_the_servers_hold_them_in(fake_vllms):
    """fp32 master weights go on the wire as the servers' bf16 (half the bytes, nothing cast on
    arrival) unless the caller names a dtype; servers that disagree are refused."""
    (url, handler), (other, other_handler) = fake_vllms
    handler.served = other_handler.served = "bfloat16"
    stream = WeightStream([url, other])
    assert stream.served_dtype == torch.bfloat16
    w = torch.randn(4, 3)
    stream.push([("w", w)], 1)
    for h in (handler, other_handler):
        assert h.state["received"]["w"].dtype == torch.bfloat16
        assert torch.equal(h.state["received"]["w"], w.to(torch.bfloat16))
    stream.push([("w", w)], 2, torch.float32)  # named: as named
    assert handler.state["received"]["w"].dtype == torch.float32
    stream.close()

    other_handler.served = "float16"
    with pytest.raises(WeightSyncError, match="different dtypes \\(bfloat16, float16\\).*same serve.dtype"):
        WeightStream([url, other])


def test_an_nccl_stream_first_checks_that_both_ends_link_the_same_nccl(fake_vllms, monkeypatch):
    """Different NCCL builds abort the process ("Mismatched NCCL version") when their group forms:
    the trainer asks each server's workers first and refuses with both versions and the fix."""
    from arpo_lib.serving import weight_sync

    (url, handler), (other, _) = fake_vllms
    handler.world = 2  # a tensor-parallel server: each worker answers
    monkeypatch.setattr(weight_sync, "runtime_versions", lambda: {"torch": "2.10.0+cu130", "nccl": "2.28.9"})
    with pytest.raises(WeightSyncError, match=r"NCCL 2\.28\.9.*torch 2\.9\.0\+cu128 with NCCL 2\.27\.3.*"
                                              r"same torch build.*stream_backend=gloo.*weight_sync=reload"):
        WeightStream([other, url], backend="nccl")
    assert "/init_weight_transfer_engine" not in handler.state.get("calls", [])  # no group was started

    handler.versions = {"torch": "2.10.0+cu130", "nccl": "2.28.9"}
    weight_sync.check_same_nccl([url], weight_sync.runtime_versions())  # the same: the stream may start
    handler.versions = {"torch": "2.10.0+cpu", "nccl": None}
    with pytest.raises(WeightSyncError, match="with NCCL none"):
        weight_sync.check_same_nccl([url], weight_sync.runtime_versions())
    with pytest.raises(WeightSyncError, match="this trainer has torch 2.10.0 with NCCL none"):
        weight_sync.check_same_nccl([url], {"torch": "2.10.0", "nccl": None})

    handler.world, asked = 1, handler.state["rpcs"].count("arpo_runtime_versions")
    WeightStream([url]).close()  # gloo: no NCCL, nothing asked
    assert handler.state["rpcs"].count("arpo_runtime_versions") == asked
