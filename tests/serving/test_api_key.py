"""A server other machines can reach needs an API key (the GPU on one machine, the VMs on another).

The refusals are checked without a server; the key itself on our real server subprocess: /health
open, /v1/* refused without the key or with a wrong one, served with it, through the client the
workflows use. vLLM's --api-key, on the real vLLM server, is in tests/serving/test_vllm.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from arpo_lib import build
from arpo_lib.agent.client import ServerError, ServerRequestError, chat_completion, ui_tars_messages
from arpo_lib.agent.server_policy import ServerPolicy
from arpo_lib.run.config import ConfigError, load_config
from arpo_lib.run.net import is_loopback
from arpo_lib.serving.launch import ServerSpec, UnprotectedServerError, api_key_from_env, start_server

KEY_VAR = "ARPO_TEST_SERVE_KEY"
KEY = "k3y-for-tests-only-0123456789"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("my-gpu-box", False), ("", False),
])
def test_loopback_is_only_this_machine(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_reachable_server_without_a_key_is_refused(backend):
    with pytest.raises(UnprotectedServerError, match="api_key_env"):
        ServerSpec(model="m", backend=backend, host="0.0.0.0")
    ServerSpec(model="m", backend=backend, host="0.0.0.0", api_key_env=KEY_VAR)  # with a key: fine
    ServerSpec(model="m", backend=backend, host="127.0.0.1")  # loopback: no key needed


def test_vllm_weight_sync_stays_on_loopback_even_with_a_key():
    """vLLM's --api-key guards /v1 only; weight sync opens /collective_rpc and /pause."""
    with pytest.raises(UnprotectedServerError, match="development endpoints"):
        ServerSpec(model="m", backend="vllm", host="0.0.0.0", api_key_env=KEY_VAR, options={"weight_sync": True})


def test_the_key_never_goes_on_a_command_line(monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)
    hf = ServerSpec(model="m", backend="hf", host="0.0.0.0", api_key_env=KEY_VAR)
    assert KEY not in " ".join(hf.command()) and hf.command()[-2:] == ["--api-key-env", KEY_VAR]
    vllm = ServerSpec(model="m", backend="vllm", host="0.0.0.0", api_key_env=KEY_VAR)
    assert KEY not in " ".join(vllm.command()) and "--api-key" not in vllm.command()
    assert vllm.environment()["VLLM_API_KEY"] == KEY  # vLLM reads its key from this variable


def test_a_named_key_that_is_not_set_is_an_error(monkeypatch):
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(ServerError, match=f"{KEY_VAR} is not set"):
        api_key_from_env(KEY_VAR)
    monkeypatch.setenv(KEY_VAR, "")
    with pytest.raises(ServerError, match="empty"):
        api_key_from_env(KEY_VAR)
    with pytest.raises(ValueError, match="NAME"):
        api_key_from_env("sk-the-key-itself!")
    assert api_key_from_env(None) is None


def test_config_refuses_a_reachable_server_without_a_key():
    with pytest.raises(ConfigError, match="serve.host"):
        load_config(None, ["serve.host=0.0.0.0"])
    with pytest.raises(ConfigError, match="serve.weight_sync"):
        load_config(None, ["serve.host=0.0.0.0", f"serve.api_key_env={KEY_VAR}", "serve.weight_sync=true"])
    with pytest.raises(ConfigError, match="serve.api_key_env"):
        load_config(None, ["serve.host=0.0.0.0", "serve.api_key_env=sk-123"])
    cfg = load_config(None, ["serve.host=0.0.0.0", f"serve.api_key_env={KEY_VAR}"])
    assert cfg.serve.api_key_env == KEY_VAR


def test_a_client_of_a_server_this_run_started_sends_its_key(monkeypatch, tiny_qwen2vl):
    monkeypatch.setenv(KEY_VAR, KEY)
    monkeypatch.setenv("ARPO_TEST_OTHER_KEY", "other")
    cfg = load_config(None, [f"model.path={tiny_qwen2vl}", f"serve.api_key_env={KEY_VAR}", "rollout.server_model=m"])
    assert build.server_policy(cfg, "http://127.0.0.1:1/v1")._api_key == KEY  # started here: serve's key
    cfg = load_config(None, [f"model.path={tiny_qwen2vl}", f"serve.api_key_env={KEY_VAR}", "rollout.server_model=m",
                             "rollout.server_url=http://gpu:8000/v1", "rollout.api_key_env=ARPO_TEST_OTHER_KEY"])
    assert build.server_policy(cfg)._api_key == "other"  # a remote server: the client's own variable
    cfg = load_config(None, [f"model.path={tiny_qwen2vl}", f"serve.api_key_env={KEY_VAR}", "rollout.server_model=m",
                             "rollout.server_url=http://gpu:8000/v1"])
    assert build.server_policy(cfg)._api_key is None  # serve.* describes servers this run starts


def test_our_server_refuses_to_listen_beyond_loopback_without_a_key(tiny_qwen2vl):
    done = subprocess.run([sys.executable, "-m", "arpo_lib.serving.server", "--model", str(tiny_qwen2vl),
                           "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "without an API key" in done.stderr


@pytest.fixture(scope="module")
def keyed_server(tiny_qwen2vl, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_VAR, KEY)
    handle = start_server(tiny_qwen2vl, device="cpu", threads=1, max_new_tokens=8, served_model_name="tiny",
                          api_key_env=KEY_VAR, log_path=tmp_path_factory.mktemp("keyed") / "server.log")
    try:
        handle.wait_healthy(timeout_s=60, poll_s=0.2)
        yield handle
    finally:
        handle.stop()
        mp.undo()


def _get(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        assert body["error"]["type"] == "authentication_error"
        return exc.code


@pytest.mark.slow
def test_keyed_server_serves_only_requests_with_the_key(keyed_server, tiny_qwen2vl, monkeypatch):
    from PIL import Image

    assert _get(keyed_server.url + "/health") == 200  # launchers and load balancers need no key
    assert _get(keyed_server.base_url + "/models") == 401
    assert _get(keyed_server.base_url + "/models", "wrong") == 401
    assert _get(keyed_server.base_url + "/models", KEY) == 200
    messages = ui_tars_messages("Click OK", [Image.new("RGB", (64, 64), "white")], [])
    with pytest.raises(ServerRequestError, match="rollout.api_key_env") as refused:
        chat_completion(keyed_server.base_url, messages, model="tiny", max_tokens=4)
    assert refused.value.status == 401
    answer = chat_completion(keyed_server.base_url, messages, model="tiny", max_tokens=4, api_key=KEY)
    assert answer["choices"][0]["message"]["role"] == "assistant"
    monkeypatch.setenv("ARPO_TEST_CLIENT_KEY", KEY)
    policy = ServerPolicy(keyed_server.base_url, tiny_qwen2vl, api_key_env="ARPO_TEST_CLIENT_KEY", max_new_tokens=4)
    try:
        assert policy._first_model() == "tiny"  # the key travels with every request of the client
    finally:
        policy.close()
    assert KEY not in keyed_server.log_path.read_text()  # the log never shows it


@pytest.mark.slow
def test_gpu_machine_and_vm_machine_flow(tiny_qwen2vl, tmp_path, monkeypatch, chromium_available):
    """The two-machine flow of docs/osworld.md ("A GPU on one machine, the VMs on another") on one
    machine: the server notebook listens beyond loopback with a key and stays up; the evaluation
    notebook reaches it by URL with the key; then it stops."""
    from arpo_lib.serving.launch import stop_server
    from arpo_lib.workflows import execute_notebook

    monkeypatch.setenv(KEY_VAR, KEY)
    common = [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "env.tasks=[miniwob/click-test]",
              "logging.progress=false"]
    out = execute_notebook("notebooks/gpu_inference_server.ipynb", {"overrides": [
        *common, "serve.host=0.0.0.0", f"serve.api_key_env={KEY_VAR}", "serve.keep_running=true"]},
        run_name="gpu", out_dir=tmp_path)
    info = json.loads((tmp_path / "gpu" / "server.json").read_text())
    try:
        text = out.read_text()
        assert "'refused_without_key': True" in text and f"rollout.api_key_env={KEY_VAR}" in text
        assert info["api_key_env"] == KEY_VAR and KEY not in text and KEY not in json.dumps(info)
        port = info["url"].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}/v1"  # the other machine's view of it
        out = execute_notebook("notebooks/evaluation.ipynb", {"config": "configs/smoke.yaml", "overrides": [
            *common, "eval.samples_per_task=1", "env.workers=1", "rollout.backend=server",
            f"rollout.server_url={url}", f"rollout.api_key_env={KEY_VAR}"]}, run_name="vm", out_dir=tmp_path)
        assert f"generating with {tiny_qwen2vl.name} at {url}" in out.read_text()
    finally:
        stop_server(info["pid"])


def test_a_short_key_cannot_protect_a_reachable_server(tiny_qwen2vl, monkeypatch):
    """The OSWorld fork's runner sends the fixed key 'empty': a server beyond loopback with such a
    key would be open to anyone who read the fork's code. Refused by our server and the launcher
    (vLLM too) before anything starts; loopback needs no key, so any is fine there."""
    from arpo_lib.run.net import weak_key_reason

    assert "empty" in weak_key_reason("empty", "0.0.0.0") and "SSH tunnel" in weak_key_reason("x" * 15, "10.0.0.5")
    assert weak_key_reason("empty", "127.0.0.1") is None and weak_key_reason(KEY, "0.0.0.0") is None
    monkeypatch.setenv(KEY_VAR, "empty")
    for backend in ("hf", "vllm"):
        with pytest.raises(UnprotectedServerError, match="5 characters"):
            start_server(tiny_qwen2vl, backend=backend, host="0.0.0.0", api_key_env=KEY_VAR, python=sys.executable)
    done = subprocess.run([sys.executable, "-m", "arpo_lib.serving.server", "--model", str(tiny_qwen2vl),
                           "--host", "0.0.0.0", "--port", "0", "--api-key-env", KEY_VAR],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the OSWorld fork's runner sends 'empty'" in done.stderr


@pytest.mark.slow
def test_the_forks_runner_reaches_a_loopback_server_by_its_model_name(tiny_qwen2vl, tmp_path):
    """The request the fork's UI-TARS agent sends (mm_agents/uitars_agent.py: OpenAI(base_url,
    api_key="empty"), model "ui-tars", frequency_penalty 1, its system line, the prompt, then the
    screenshot as a PNG data URL) answered by our server on 127.0.0.1 (reached from the VM machine
    through `ssh -L`) served as `ui-tars`: no key configured, the fork's "empty" ignored."""
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(png, format="PNG")
    request_body = {"model": "ui-tars", "frequency_penalty": 1, "max_tokens": 8, "temperature": 0.0, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": [{"type": "text", "text": "You are a GUI agent. ... ## User Instruction\nClick OK"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}]},
    ]}
    handle = start_server(tiny_qwen2vl, device="cpu", threads=1, max_new_tokens=8, served_model_name="ui-tars",
                          log_path=tmp_path / "server.log")
    try:
        handle.wait_healthy(timeout_s=60, poll_s=0.2)
        request = urllib.request.Request(handle.base_url + "/chat/completions", data=json.dumps(request_body).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": "Bearer empty"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        with urllib.request.urlopen(urllib.request.Request(handle.base_url + "/models", headers={
                "Authorization": "Bearer empty"}), timeout=30) as resp:
            models = json.loads(resp.read())
    finally:
        handle.stop()
    assert answer["model"] == "ui-tars" and isinstance(answer["choices"][0]["message"]["content"], str)
    assert [m["id"] for m in models["data"]] == ["ui-tars"]
