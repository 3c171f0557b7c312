"""Rollouts that run ahead of the update (`rollout.max_staleness`, asynchronous ARPO): the next batch plays
on the servers while the trainer updates, each push lands between two requests (never within
one), every response records the version that produced it, and the stale ones are weighed."""
from __future__ import annotations

import json
import threading
import time

import pytest

from arpo_lib.run.config import ConfigError, load_config
from arpo_lib.serving.weight_sync import VersionLock, VersionedPolicy
from arpo_lib.training.metrics import staleness_metrics
from arpo_lib.types import Generation, Segment, StepRecord, Trajectory

TASKS = ["miniwob/click-test", "miniwob/click-button"]


def test_a_push_waits_for_the_requests_in_flight_and_holds_new_ones_back():
    lock, events = VersionLock(), []
    in_request, release_request = threading.Event(), threading.Event()

    def request(name: str, hold: threading.Event | None = None) -> None:
        with lock.request():
            events.append(f"{name} runs")
            if hold is not None:
                in_request.set()
                hold.wait(10)
            events.append(f"{name} done")

    def push() -> None:
        with lock.push():
            events.append("push")

    first = threading.Thread(target=request, args=("first", release_request))
    first.start()
    in_request.wait(10)
    pusher = threading.Thread(target=push)
    pusher.start()
    while not lock._waiting_pushes:  # the push is waiting for the first request
        time.sleep(0.001)
    second = threading.Thread(target=request, args=("second",))
    second.start()
    time.sleep(0.1)
    assert events == ["first runs"]  # neither the push nor the request after it went on
    release_request.set()
    for t in (first, pusher, second):
        t.join(10)
    assert events == ["first runs", "first done", "push", "second runs", "second done"]


def test_a_push_inside_a_push_on_one_thread_is_the_same_push():
    """A distributed run holds every rank's requests back around rank 0's push, which takes the
    lock again on the same thread: that must not wait for itself. Another thread's push still
    waits for the outer one, and requests wait until both are done."""
    lock, events = VersionLock(), []

    def other_push() -> None:
        with lock.push():
            events.append("other push")

    def request() -> None:
        with lock.request():
            events.append("request")

    with lock.push():
        with lock.push():  # nested: does not block
            events.append("inner")
        others = [threading.Thread(target=other_push), threading.Thread(target=request)]
        for t in others:
            t.start()
        time.sleep(0.1)
        events.append("outer done")
    for t in others:
        t.join(10)
    assert events[:2] == ["inner", "outer done"] and sorted(events[2:]) == ["other push", "request"]
    assert events.index("other push") < events.index("request")  # a waiting push goes first


def test_each_response_records_the_version_that_produced_it():
    class Client:
        def generate(self, segments, **kwargs):
            return [Generation("a", [1], [0.0]) for _ in segments]

    class Served:
        client, served_version, version_lock = Client(), 3, VersionLock()

    served = Served()
    policy = VersionedPolicy(served)  # type: ignore[arg-type]
    assert [g.weights_version for g in policy.generate(["s", "t"])] == [3, 3]
    served.served_version = 4
    assert policy.generate(["s"])[0].weights_version == 4


def test_staleness_is_counted_per_response():
    def traj(version, steps, ok=True):
        t = Trajectory(task="t", seed=0, sample=0, policy_version=version)
        t.steps = [StepRecord(i + 1, "", [], None, 0.0, False, False, 0.0, weights_version=v) for i, v in enumerate(steps)]
        if not ok:
            t.status = "env_error"
        return t

    # update from version 5: a batch started at 4 whose push landed after its first two responses
    trajs = [traj(4, [4, 4, 5]), traj(4, [4, 5]), traj(5, [None, None]), traj(2, [2], ok=False)]
    # no token data: each response counts one token
    assert staleness_metrics(trajs, 5) == {"staleness_mean": 3 / 7, "staleness_max": 1.0, "stale_fraction": 3 / 7,
                                           "staleness_token_mean": 3 / 7, "stale_token_fraction": 3 / 7}
    assert staleness_metrics([], 5) == {}
    # with tokens: the first trajectory's responses are 2, 3 and 1 tokens long (prompt and
    # screenshot tokens between them are not trained on), the second's 4 and 2 (two segments)
    trajs[0].segments = [Segment(input_ids=list(range(10)), loss_mask=[0, 1, 1, 0, 0, 1, 1, 1, 0, 1])]
    trajs[1].segments = [Segment(input_ids=list(range(5)), loss_mask=[0, 1, 1, 1, 1]),
                         Segment(input_ids=list(range(3)), loss_mask=[0, 1, 1])]
    metrics = staleness_metrics(trajs[:2], 5)
    stale_tokens = 2 + 3 + 4  # the responses sampled by version 4
    assert metrics["staleness_token_mean"] == stale_tokens / 12 == metrics["stale_token_fraction"]
    assert metrics["staleness_mean"] == 3 / 5


def test_rollouts_ahead_need_servers_that_take_new_weights():
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness: .*rollout\.backend=server"):
        load_config("configs/smoke.yaml", ["rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness: .*weight_sync=none"):
        load_config("configs/smoke.yaml", ["rollout.max_staleness=1", "rollout.backend=server"])
    with pytest.raises(ConfigError, match=r"algo\.stale_correction"):
        load_config("configs/smoke.yaml", ["algo.stale_correction=maybe"])
    load_config("configs/smoke.yaml", ["rollout.max_staleness=1", "rollout.backend=server",
                                       "rollout.weight_sync=restart"])


def test_the_next_batch_plays_on_the_server_while_the_update_runs(warm_tiny_qwen2vl, tmp_path, chromium_available):
    """Three ARPO steps through our hf server, staleness 1: batch 2 and 3 start with the step before
    (on the environments its batch no longer needs, then through its update), on the weights the server holds; the restart that brings it the new
    weights waits for their requests in flight. Step 1 is on-policy, later steps record the
    versions that produced each response (some one behind), and the metrics say how stale."""
    from arpo_lib import build
    from arpo_lib.rollout.store import read_trajectory

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={warm_tiny_qwen2vl}", f"out_dir={tmp_path}", "name=ahead", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=2", "env.max_steps=2", "model.max_new_tokens=32", "rollout.group_size=2",
        "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=3", "train.lr=3e-3",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1", "rollout.backend=server",
        "rollout.weight_sync=restart", "serve.backend=hf", "rollout.max_staleness=1", "rollout.mode=async",
        "logging.progress=false"])
    seen_ahead = []
    with build.trainer(cfg) as trainer:
        update = trainer.update

        def spied(groups):
            seen_ahead.append(sorted(trainer.rollouts._ahead))  # batches running while this update runs
            if len(seen_ahead) == 1:  # the first update lasts until the next batch has asked the server once
                served, before = trainer.rollouts.served, trainer.rollouts.served.client.requests
                deadline = time.monotonic() + 120
                while served.client.requests == before and time.monotonic() < deadline:
                    time.sleep(0.05)
            return update(groups)

        trainer.update = spied
        history = trainer.train()
    assert seen_ahead == [[1], [2], []]  # (steps count from 0 in the rollout directories)
    assert [m["step"] for m in history] == [1, 2, 3] and all(m["optimizer_steps"] == 1 for m in history)
    assert history[0]["staleness_max"] == 0.0
    assert all(m["staleness_max"] <= 1.0 for m in history) and history[1]["staleness_max"] == 1.0
    versions = set()
    for meta in (tmp_path / "ahead" / "rollouts" / "step_000001").rglob("meta.json"):
        stored = read_trajectory(meta.parent)
        versions |= {s.weights_version for s in stored.trajectory.steps}
        lines = [json.loads(line) for line in (meta.parent / "traj.jsonl").read_text().splitlines()]
        assert all("weights_version" in line for line in lines)
    assert versions == {0, 1}  # the push of version 1 landed between two of batch 1's requests


def test_a_run_playing_ahead_evaluates_checkpoints_and_resumes(warm_tiny_qwen2vl, tmp_path, chromium_available):
    """Staleness 1 in async mode through our hf server: the run stops after its first step, with
    batch 2 playing ahead; that batch is not in the checkpoint (closing the trainer ends it, its
    episodes never scored). The resumed run plays batch 2 again from the checkpoint's weights (on
    policy: staleness 0), batch 3 ahead of its update; the evaluation at step 2 waits for the batch
    ahead, then takes the environments. Every step is in the metrics once."""
    from arpo_lib import build

    common = [f"model.path={warm_tiny_qwen2vl}", f"out_dir={tmp_path}", "name=resumed",
              f"env.tasks=[{','.join(TASKS)}]", "env.workers=2", "env.max_steps=2", "model.max_new_tokens=32",
              "rollout.group_size=2", "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=3",
              "train.lr=3e-3", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1",
              "rollout.backend=server", "rollout.weight_sync=restart", "serve.backend=hf", "rollout.max_staleness=1",
              "rollout.mode=async", "train.checkpoint_every=1", "train.eval_every=2", "eval.samples_per_task=1",
              "logging.progress=false"]
    cfg = load_config("configs/smoke.yaml", common)
    with build.trainer(cfg) as trainer:
        first = trainer.train(steps=1)
        assert sorted(trainer.rollouts._ahead) == [1]  # batch 2 was playing when the run stopped
    assert [m["step"] for m in first] == [1]
    run = tmp_path / "resumed"
    assert (run / "checkpoints" / "step_000001").is_dir()
    with build.trainer(load_config("configs/smoke.yaml", common), resume=True) as trainer:
        assert trainer.step == 1
        rest = trainer.train()
    assert [m["step"] for m in rest] == [2, 3]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    replayed, ahead = rest
    assert replayed["staleness_max"] == 0.0 and replayed["env_errors"] == 0  # played again, on policy
    assert ahead["staleness_max"] <= 1.0 and ahead["env_errors"] == 0
    assert "eval_success_rate" in replayed and (run / "eval").is_dir()
    episodes = list((run / "rollouts" / "step_000001").rglob("meta.json"))
    assert len(episodes) == 4 and all(json.loads(p.read_text())["status"] == "ok" for p in episodes)
