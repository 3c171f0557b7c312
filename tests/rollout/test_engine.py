"""Rollouts with real headless Chromium and the real tiny model."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.envs.workers.worker import EnvSetupError
from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.store import load_trajectory
from arpo_lib.types import EpisodeRequest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(tiny_qwen2vl):
    return HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=32)


@pytest.fixture(scope="module")
def pool(chromium_available):
    with EnvPool(2, {"scale": 2, "max_steps": 3}, timeout_s=60, cache_size=2) as p:
        yield p


def _requests(tasks, n):
    return [EpisodeRequest(t, 100 + i, i) for t in tasks for i in range(n)]


def test_rollout_writes_osworld_layout_and_reloads_exactly(policy, pool, tmp_path):
    torch.manual_seed(0)
    engine = RolloutEngine(policy, pool, max_steps=3)
    trajs = engine.run(_requests(["miniwob/click-test", "miniwob/click-button"], 2), out_dir=tmp_path, progress=False)
    assert [t.task for t in trajs] == ["miniwob/click-test"] * 2 + ["miniwob/click-button"] * 2
    for t in trajs:
        assert t.status == "ok", t.error
        assert t.instruction  # the task's utterance
        d = tmp_path / "miniwob" / t.task.split("/")[1] / str(t.sample)
        assert t.directory == str(d)
        assert (d / "result.txt").read_text().strip() == str(t.task_score)
        lines = [json.loads(x) for x in (d / "traj.jsonl").read_text().splitlines()]
        assert len(lines) == t.num_steps >= 1
        assert all({"step_num", "response", "action", "reward", "done"} <= set(x) for x in lines)
        assert (d / "step_0.png").is_file()
        # The random tiny model writes unparsable text: a format failure, scored, never a crash.
        if not t.format_ok:
            assert t.reward == pytest.approx(t.task_score - 0.5)
            assert lines[-1]["parse_error"]
        # Reload from disk: same tokens, same pixels, same log-probs.
        back = load_trajectory(d, policy.processor)
        assert len(back.segments) == len(t.segments)
        for a, b in zip(t.segments, back.segments):
            assert a.token_data() == b.token_data()
            assert torch.equal(torch.cat(a.pixel_values), torch.cat(b.pixel_values))
            assert torch.equal(torch.stack(a.image_grid_thw), torch.stack(b.image_grid_thw))
            with torch.no_grad():
                assert torch.allclose(policy.sequence_logprobs([a])[0], policy.sequence_logprobs([b])[0])


def test_screenshots_seen_by_the_model_are_the_saved_ones(policy, pool, tmp_path):
    from PIL import Image

    engine = RolloutEngine(policy, pool, max_steps=3)
    (t,) = engine.run(_requests(["miniwob/click-test"], 1), out_dir=tmp_path, progress=False)
    img = Image.open(os.path.join(t.directory, "step_0.png"))
    assert img.size == (320, 420)  # 160x210 CSS px at scale 2
    enc = policy.processor.image_processor(images=[img.convert("RGB")], return_tensors="pt")
    assert torch.equal(enc["pixel_values"], t.segments[0].pixel_values[0])


def test_killed_worker_is_an_infrastructure_failure_and_the_batch_completes(policy, pool):
    engine = RolloutEngine(policy, pool, max_steps=3)
    killed = []

    def kill_worker(traj):
        if not killed:
            w = pool.workers[0]
            os.killpg(w.process.pid, signal.SIGKILL)
            killed.append(w.process.pid)

    trajs = engine.run(_requests(["miniwob/click-test"], 6), progress=False, on_finish=kill_worker)
    assert len(trajs) == 6
    errors = [t for t in trajs if t.status == "env_error"]
    assert errors, "the killed worker's next episode must be reported as an infrastructure failure"
    assert all(t.reward == 0.0 and not t.segments for t in errors)
    assert sum(t.status == "ok" for t in trajs) >= 4
    assert pool.workers[0].process.pid != killed[0] and pool.workers[0].process.is_alive()
    # The pool works normally afterwards.
    again = engine.run(_requests(["miniwob/click-test"], 2), progress=False)
    assert all(t.status == "ok" for t in again)


def test_unknown_environment_stops_the_run_with_a_clear_error(policy, chromium_available):
    with EnvPool(1, {}, timeout_s=60) as p:
        engine = RolloutEngine(policy, p)
        with pytest.raises(EnvSetupError, match="click-buton"):
            engine.run([EpisodeRequest("miniwob/click-buton", 0)], progress=False)


def test_missing_browser_says_what_to_do(policy, monkeypatch):
    monkeypatch.setenv("MINIWOB_CHROME_BINARY", "/nonexistent/chromium")
    with EnvPool(1, {}, timeout_s=60) as p:
        engine = RolloutEngine(policy, p)
        with pytest.raises(EnvSetupError, match="workbench setup"):
            engine.run([EpisodeRequest("miniwob/click-test", 0)], progress=False)
