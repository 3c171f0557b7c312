"""The OpenAI-compatible server on the tiny model, its launcher, and the client.

The server tests start the real `python -m arpo_lib.serving` subprocess (marked slow); request
parsing, the vLLM command line and the launcher's refusals are tested without one.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.agent.client import ServerError, ServerRequestError, chat_completion, encode_image, ui_tars_messages
from arpo_lib.serving.launch import PortInUseError, ServerSpec, VLLMNotInstalledError, start_server, stop_server
from arpo_lib.serving.server import RequestError, decode_data_url, parse_chat_request
from arpo_lib.types import SamplingParams

INSTRUCTION = "Click the OK button"
PREVIOUS = "Thought: The OK button is at the bottom.\nAction: click(start_box='(120,340)')"


def _shot(seed: int, size: tuple[int, int] = (160, 200)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def server(tiny_qwen2vl, tmp_path_factory):
    handle = start_server(tiny_qwen2vl, device="cpu", threads=1, max_new_tokens=12, served_model_name="tiny",
                          log_path=tmp_path_factory.mktemp("server") / "server.log")
    try:
        handle.wait_healthy(timeout_s=60, poll_s=0.2)
        yield handle
    finally:
        handle.stop()


# -- requests, without a server --------------------------------------------------------------
def test_request_parsing_converts_openai_messages():
    req = parse_chat_request({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": encode_image(_shot(0))}}]},
    ], "temperature": 0, "max_tokens": 5, "logprobs": True})
    assert req.messages[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert req.messages[1]["content"][1] == {"type": "image"}
    assert np.array_equal(np.asarray(req.images[0]), np.asarray(_shot(0)))  # PNG round trip is exact
    assert (req.temperature, req.max_tokens, req.logprobs) == (0.0, 5, True)


@pytest.mark.parametrize("body, match", [
    ([], "JSON object"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=1"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "neither text nor image_url"),
])
def test_bad_requests_are_refused(body, match):
    with pytest.raises(RequestError, match=match):
        parse_chat_request(body)


@pytest.mark.parametrize("url", ["http://example.com/a.png", "file:///etc/passwd", "/tmp/a.png",
                                 "data:text/plain;base64,aGk=", "data:image/png;base64,not-base64!"])
def test_only_image_data_urls_are_accepted(url):
    with pytest.raises(RequestError):
        decode_data_url(url)


def test_ui_tars_messages_keep_the_newest_screenshots():
    msgs = ui_tars_messages(INSTRUCTION, [_shot(0), _shot(1), _shot(2)], ["r0", "r1"], history_images=2)
    urls = [p["image_url"]["url"] for m in msgs for p in m["content"] if p["type"] == "image_url"]
    assert urls == [encode_image(_shot(1)), encode_image(_shot(2))]
    assert msgs[-1]["role"] == "user" and INSTRUCTION in msgs[1]["content"][0]["text"]


# -- launcher, without a server --------------------------------------------------------------
def test_an_episodes_screenshots_are_encoded_once_across_its_requests(monkeypatch):
    """Step k's request carries the k newest screenshots; each is PNG-encoded once while it lives
    (the same URL every time), and a new image at a dead one's id is encoded anew."""
    import gc

    from arpo_lib.agent import client

    saves = []
    real_save = Image.Image.save
    monkeypatch.setattr(Image.Image, "save", lambda self, *a, **k: (saves.append(id(self)), real_save(self, *a, **k)))
    shots, urls = [], []
    for step in range(4):
        shots.append(_shot(10 + step))
        messages = ui_tars_messages(INSTRUCTION, shots, [PREVIOUS] * step, history_images=3)
        urls.append([p["image_url"]["url"] for m in messages for p in m["content"] if p["type"] == "image_url"])
    assert len(saves) == 4, "each screenshot is encoded once, not once per request"
    assert urls[3] == urls[2][1:] + [encode_image(shots[3])] and urls[2][:2] == urls[1]
    assert urls[3][-1] == f"data:image/png;base64,{__import__('base64').b64encode(_png(shots[3])).decode()}"
    dead = id(shots[0])
    del shots[0], messages, urls
    gc.collect()
    assert dead not in client._ENCODED  # gone with its image
    other = _shot(99)
    assert decode_data_url(encode_image(other)).tobytes() == other.tobytes()


def _png(image: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_vllm_command_has_the_flags_ui_tars_needs():
    spec = ServerSpec("/models/UI-TARS-1.5-7B", backend="vllm", port=8123, options={"max_images": 15, "device": "cuda"},
                      extra_args=("--seed", "0"), python="/venvs/vllm/bin/python")
    cmd = spec.command()
    assert cmd[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == "/models/UI-TARS-1.5-7B" and flags["--port"] == "8123"
    assert flags["--host"] == "127.0.0.1" and flags["--served-model-name"] == "UI-TARS-1.5-7B"
    assert json.loads(cmd[cmd.index("--limit-mm-per-prompt") + 1]) == {"image": 15}
    assert "--enable-prefix-caching" in cmd and cmd[-2:] == ["--seed", "0"]
    assert {"--max-model-len", "--dtype", "--gpu-memory-utilization"} <= set(cmd)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"  # of the distribution sampled from
    assert "--enable-lora" not in cmd and "--worker-extension-cls" not in cmd
    assert "--tensor-parallel-size" not in cmd
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.environment()
    split = ServerSpec("m", backend="vllm", options={"device": "cuda", "tensor_parallel_size": 2}).command()
    assert split[split.index("--tensor-parallel-size") + 1] == "2"


def test_vllm_cpu_command_and_environment_for_weight_sync_and_lora():
    spec = ServerSpec("m", backend="vllm", options={"device": "cpu", "weight_sync": True, "enable_lora": True,
                                                    "max_lora_rank": 8, "cpu_kv_cache_gb": 2})
    cmd = spec.command()
    assert "--gpu-memory-utilization" not in cmd
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "arpo_vllm_ext.WeightSyncExtension"
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "arpo_stream"}
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in cmd
    env = spec.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_vllm_interpreter_is_found_from_the_environment_variable(monkeypatch):
    from arpo_lib.serving.launch import find_vllm_python

    monkeypatch.setenv("ARPO_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert find_vllm_python() == "/opt/vllm/bin/python"
    monkeypatch.delenv("ARPO_VLLM_PYTHON")
    monkeypatch.setenv("VLLM_VENV", "/nonexistent-venv")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert find_vllm_python() is None


def test_unknown_backend_option_names_the_key():
    with pytest.raises(ValueError, match="max_images"):
        ServerSpec("m", backend="hf", options={"max_images": 3})
    with pytest.raises(ValueError, match="backend"):
        ServerSpec("m", backend="tgi")


def test_vllm_backend_without_vllm_is_a_clear_error(tiny_qwen2vl):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(VLLMNotInstalledError, match="vLLM is not installed.*setup_vllm_cpu.sh"):
        start_server(tiny_qwen2vl, backend="vllm", python=sys.executable)


def test_a_vllm_without_the_weight_transfer_api_is_refused_by_name_at_the_servers_start(tmp_path):
    """Regression: the extension skipped its registration silently on a vLLM without the
    weight-transfer API, and the first push failed later with vLLM's own words. Imported in a
    server (vllm loaded) it now raises naming the version it needs; in a trainer (no vllm) it
    imports as before."""
    from arpo_lib.serving.launch import VLLM_EXTENSION_DIR as EXT_DIR

    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.31.0"\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{EXT_DIR}"}
    server = subprocess.run([sys.executable, "-c", "import vllm, arpo_vllm_ext"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert server.returncode != 0
    assert "ImportError: arpo_vllm_ext (serve.weight_sync=true) needs vLLM's weight-transfer API" in server.stderr
    assert "this server's vLLM is 0.31.0: install vllm==0.32.0" in server.stderr
    trainer = subprocess.run([sys.executable, "-c", "import arpo_vllm_ext"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert trainer.returncode == 0, trainer.stderr


def test_taken_port_is_refused_before_starting(tiny_qwen2vl):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(PortInUseError, match=f"port {s.getsockname()[1]}.*already in use"):
            start_server(tiny_qwen2vl, port=s.getsockname()[1])


def test_stop_server_refuses_a_process_that_is_not_a_server():
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with pytest.raises(ServerError, match="not a server"):
            stop_server(other.pid)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    assert stop_server(other.pid) is False  # gone: nothing to stop


# -- the real server -------------------------------------------------------------------------
@pytest.mark.slow
def test_health_and_models(server):
    assert server.health()
    with urllib.request.urlopen(server.url + "/health") as resp:
        assert resp.read() == b"ok"
    with urllib.request.urlopen(server.base_url + "/models") as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]


@pytest.mark.slow
def test_greedy_completion_matches_the_in_process_policy(server, tiny_qwen2vl):
    shots = [_shot(0), _shot(1)]
    response = chat_completion(server.base_url, ui_tars_messages(INSTRUCTION, shots, [PREVIOUS]),
                               model=server.model, temperature=0, max_tokens=12, logprobs=True)
    choice = response["choices"][0]
    assert response["object"] == "chat.completion" and response["model"] == "tiny"
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")

    # The same conversation built token by token the way rollouts build it.
    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=12)
    conv = policy.new_conversation(INSTRUCTION)
    conv.add_observation(shots[0])
    previous_ids = policy.tokenizer.encode(PREVIOUS) + [conv.eos_id]
    conv.add_response(PREVIOUS, previous_ids, [0.0] * len(previous_ids))
    conv.add_observation(shots[1])
    expected = policy.generate([conv.current], sampling=SamplingParams(temperature=0, max_new_tokens=12))[0]

    assert choice["message"]["content"] == expected.text
    assert choice["token_ids"] == expected.token_ids
    assert response["usage"]["prompt_tokens"] == len(conv.current)
    assert response["usage"]["completion_tokens"] == len(expected.token_ids)
    served = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert all(math.isfinite(lp) and lp <= 0 for lp in served)
    assert torch.allclose(torch.tensor(served), torch.tensor(expected.logprobs), atol=1e-4)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(server):
    messages = [{"role": "user", "content": "hello"}]
    # An unseeded request in between must not change what the seeded one samples.
    runs = [chat_completion(server.base_url, messages, model=server.model, temperature=1.0, max_tokens=8, seed=seed)
            for seed in (7, None, 7)]
    runs.pop(1)
    assert runs[0]["choices"][0]["message"] == runs[1]["choices"][0]["message"]
    assert runs[0]["choices"][0]["logprobs"] is None and "token_ids" not in runs[0]["choices"][0]
    with_ids = chat_completion(server.base_url, messages, model=server.model, temperature=1.0, max_tokens=8,
                               seed=7, return_token_ids=True)["choices"][0]
    assert with_ids["message"] == runs[0]["choices"][0]["message"] and with_ids["logprobs"] is None
    assert len(with_ids["token_ids"]) == runs[0]["usage"]["completion_tokens"]


@pytest.mark.slow
def test_server_answers_bad_requests_with_openai_errors(server):
    url = server.base_url + "/chat/completions"
    status, body = _post(url, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(url, json.dumps({"model": "tiny"}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    remote = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}
    with pytest.raises(ServerRequestError, match="400.*data: image URLs"):
        chat_completion(server.base_url, [remote], model=server.model)
    status, body = _post(server.url + "/v1/completions", b"{}")
    assert status == 404 and "error" in body
    assert server.health()  # still serving after all that


@pytest.mark.slow
def test_each_replica_of_a_fleet_gets_its_own_devices_port_log_and_record(tiny_qwen2vl, tmp_path):
    """build.server for replica 1 of serve.replicas=2 with serve.cuda_devices: the server process
    sees its own CUDA_VISIBLE_DEVICES; its log and record do not overwrite replica 0's."""
    from arpo_lib import build

    cfg = build.load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=fleet",
                                                   "serve.replicas=2", 'serve.cuda_devices=["0,1","2,3"]'])
    handle = build.server(cfg, replica=1)
    try:
        env = Path(f"/proc/{handle.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=2,3" in env
        record = json.loads((tmp_path / "fleet" / "server_1.json").read_text())
        assert record["pid"] == handle.pid and record["log_path"].endswith("server_1.log")
        assert not (tmp_path / "fleet" / "server.json").exists()
    finally:
        handle.stop()


@pytest.mark.slow
def test_an_evaluation_spreads_its_episodes_over_servers_given_by_url(tiny_qwen2vl, tmp_path, chromium_available):
    """rollout.server_url as a list: build.engine connects to every server, the episodes go to both."""
    from arpo_lib import build
    from arpo_lib.agent.server_policy import FleetPolicy
    from arpo_lib.evaluation.evaluate import evaluate_run

    handles = [start_server(tiny_qwen2vl, device="cpu", threads=1, max_new_tokens=12,
                            log_path=tmp_path / f"server{i}.log") for i in range(2)]
    try:
        for handle in handles:
            handle.wait_healthy(timeout_s=60, poll_s=0.2)
        urls = [h.base_url for h in handles]
        cfg = build.load_config("configs/smoke.yaml", [
            f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=two", "env.tasks=[miniwob/click-test]",
            "env.workers=2", "env.max_steps=1", "eval.samples_per_task=4", "logging.progress=false",
            "rollout.backend=server", f"rollout.server_url=[{', '.join(urls)}]"])
        with build.engine(cfg) as engine:
            assert isinstance(engine.policy, FleetPolicy) and engine.policy.base_urls == urls
            result = evaluate_run(engine, cfg, tmp_path / "two" / "eval")
            assert result.to_dict()["episodes"] == 4
            assert [c.requests for c in engine.policy.clients] == [2, 2]  # one step per episode, spread evenly
    finally:
        for handle in handles:
            handle.stop()


def test_stop_leaves_no_process(tiny_qwen2vl, tmp_path):
    handle = start_server(tiny_qwen2vl, device="cpu", threads=1, log_path=tmp_path / "server.log")
    handle.wait_healthy(timeout_s=60, poll_s=0.2)
    assert stop_server(handle.pid) is True  # as a later process would, from the saved pid
    assert _gone(handle.pid) and not handle.health()
    handle.stop()  # idempotent
    assert "shutting down" in (tmp_path / "server.log").read_text()


@pytest.mark.slow
def test_missing_model_fails_fast_with_the_log_tail(tmp_path):
    with start_server(tmp_path / "no-such-model", device="cpu", threads=1, log_path=tmp_path / "log") as handle:
        with pytest.raises(ServerError, match=r"(?s)exited with code 1.*no-such-model does not exist"):
            handle.wait_healthy(timeout_s=45, poll_s=0.2)
    assert _gone(handle.pid)


def test_client_gives_up_on_an_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(ServerError, match="after 2 attempts"):
            chat_completion(f"http://127.0.0.1:{port}/v1", [{"role": "user", "content": "x"}], model="m",
                            retries=1, backoff_s=0.01)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_stopping_a_server_group_waits_until_its_helpers_are_gone():
    """A stopped server's helpers (vLLM's engine process) are SIGKILLed with its group, and the stop
    returns only once none is left alive: SIGKILL is delivered asynchronously (a clean-clone run once
    saw the engine still alive the instant after stop). `_wait_group_gone` must see a live member."""
    import time

    from arpo_lib.serving.launch import _kill_group, _wait_group_gone

    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
                               "time.sleep(60)"], start_new_session=True)
    try:
        time.sleep(1.0)  # the helper started
        assert _wait_group_gone(leader.pid, 0.2) is False  # the leader and its helper are alive
        _kill_group(leader.pid, timeout_s=5.0)
        leader.wait(timeout=5)
        assert _wait_group_gone(leader.pid, 0.0) is True  # nothing left the instant the stop returned
    finally:
        if leader.poll() is None:
            leader.kill()
