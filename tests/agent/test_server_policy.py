"""ServerPolicy against our own `hf` server (fast, no vLLM): the client side of the server backend,
and training through a server with weight sync by restart. The same against vLLM:
tests/serving/test_vllm.py."""
from __future__ import annotations

import pytest
import torch

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest
from arpo_lib.agent.server_policy import ACTION_REGEX, ServerPolicy
from arpo_lib.agent.client import ServerError
from arpo_lib.serving.launch import start_server

pytestmark = pytest.mark.slow
TASKS = ["miniwob/click-test", "miniwob/click-button"]


@pytest.fixture(scope="module")
def hf_server(warm_tiny_qwen2vl):
    with start_server(warm_tiny_qwen2vl, backend="hf", device="cpu", threads=1, max_new_tokens=48) as handle:
        handle.wait_healthy(timeout_s=120)
        yield handle


def test_rollouts_through_the_server_equal_in_process_rollouts(hf_server, warm_tiny_qwen2vl, chromium_available):
    client = ServerPolicy(hf_server.base_url, warm_tiny_qwen2vl, max_new_tokens=48, history_images=5)
    local = HFPolicy(warm_tiny_qwen2vl, device="cpu", max_new_tokens=48, history_images=5)
    requests = [EpisodeRequest(t, 60 + i, i) for t in TASKS for i in range(2)]
    try:
        with EnvPool(2, {"scale": 2, "max_steps": 3}) as pool:
            remote = RolloutEngine(client, pool, max_steps=3).run(requests, temperature=0.0, progress=False)
            here = RolloutEngine(local, pool, max_steps=3).run(requests, temperature=0.0, progress=False)
    finally:
        client.close()
    for a, b in zip(remote, here):
        assert [s.response for s in a.steps] == [s.response for s in b.steps]
        assert [s.actions for s in a.steps] == [s.actions for s in b.steps] and a.task_score == b.task_score
        assert [s.input_ids for s in a.segments] == [s.input_ids for s in b.segments]
    assert client.requests >= len(requests) and client.prompt_mismatches == 0 and client.inexact == 0
    assert any(s.actions for t in remote for s in t.steps)


def test_api_key_comes_from_a_named_environment_variable(hf_server, warm_tiny_qwen2vl, monkeypatch):
    monkeypatch.delenv("ARPO_TEST_KEY", raising=False)
    with pytest.raises(ServerError, match="ARPO_TEST_KEY is not set"):
        ServerPolicy(hf_server.base_url, warm_tiny_qwen2vl, api_key_env="ARPO_TEST_KEY")
    monkeypatch.setenv("ARPO_TEST_KEY", "planted-key-not-logged-anywhere-123456")
    policy = ServerPolicy(hf_server.base_url, warm_tiny_qwen2vl, api_key_env="ARPO_TEST_KEY")
    assert "planted-key" not in repr(vars(policy))  # the key is read when sending, never kept
    policy.close()


def test_an_unreachable_server_fails_with_a_clear_error(warm_tiny_qwen2vl):
    with pytest.raises(ServerError, match="could not list the models"):
        ServerPolicy("http://127.0.0.1:9/v1", warm_tiny_qwen2vl, timeout_s=0.5)


def test_action_grammar_accepts_ui_tars_actions_and_nothing_else():
    import re

    good = ["Action: click(start_box='(12,340)')", "Thought: go\nAction: type(content='a\\'b')",
            "Action: drag(start_box='(1,2)', end_box='(3,4)')", "Action: hotkey(key='ctrl c')",
            "Action: scroll(start_box='(5,5)', direction='down')", "Action: finished(content='done')",
            "Action: wait()", "Action: call_user()"]
    bad = ["click(start_box='(1,2)')", "Action: click(start_box='(1,2)'); import os", "Action: exec('x')",
           "Action: type(content='a')\nAction: wait()", "Thought: x\n\nAction: wait()"]
    assert all(re.fullmatch(ACTION_REGEX, g) for g in good)
    assert not any(re.fullmatch(ACTION_REGEX, b) for b in bad)


def test_training_through_the_hf_server_with_restart_sync(warm_tiny_qwen2vl, tmp_path, chromium_available):
    """rollout.backend=server without a URL: the trainer starts its own server (serve.*) on its
    current weights and, with weight_sync=restart, restarts it on the updated ones."""
    from arpo_lib.run.config import load_config
    from arpo_lib import build

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={warm_tiny_qwen2vl}", f"out_dir={tmp_path}", "name=restart", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=2", "env.max_steps=2", "model.max_new_tokens=32", "rollout.group_size=2",
        "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=2", "train.lr=3e-3",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1", "rollout.backend=server",
        "rollout.weight_sync=restart", "serve.backend=hf", "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        history = trainer.train()
        server = trainer.rollouts.served.server
        assert server is not None and server.running()
        served = HFPolicy(tmp_path / "restart" / "server_weights", device="cpu")
        for name, tensor in trainer.policy.model.state_dict().items():
            assert torch.equal(tensor, served.model.state_dict()[name]), name  # the server loads the new weights
    assert [m["step"] for m in history] == [1, 2] and history[-1]["server_requests"] > 0
    assert history[-1]["seconds_sync_total"] > 0
    assert not server.running()  # closing the trainer stops the server it started
