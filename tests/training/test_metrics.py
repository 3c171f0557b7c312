"""A step's metrics from what it produced, on hand-made trajectories and groups: rates leave
infrastructure failures out, the update counts only the optimizer steps it took, and the line
keeps the field order metrics.jsonl has always had."""
from __future__ import annotations

import math

import pytest
import torch

from arpo_lib.training.metrics import UpdateMetrics, replay_ages, rollout_metrics, step_metrics, weight_stats
from arpo_lib.types import Group, Trajectory


def _traj(task: str, score: float, status: str = "ok", replayed: bool = False, version: int = 0) -> Trajectory:
    return Trajectory(task=task, seed=0, sample=0, task_score=score, reward=score, status=status, replayed=replayed,
                      policy_version=version)


def test_rates_leave_infrastructure_failures_out():
    trajs = [_traj("a", 1.0), _traj("a", 0.0), _traj("a", 0.0, status="env_error"), _traj("b", 0.0)]
    groups = [Group("a", trajs[:2], [1.0, -1.0], injected=False, all_failed=False),
              Group("b", [trajs[3], _traj("b", 1.0, replayed=True)], [-1.0, 1.0], injected=True, all_failed=True)]
    m = rollout_metrics(["a", "b"], trajs, groups)
    assert m["success_rate"] == pytest.approx(1 / 3) and m["env_errors"] == 1
    assert m["success_by_task"] == {"a": [1, 2], "b": [0, 1]}
    assert m["all_failed_groups"] == 0.5 and m["replay_injections"] == 1


def test_infrastructure_failures_are_counted_by_the_cause_their_message_names():
    def lost(error: str) -> Trajectory:
        traj = _traj("a", 0.0, status="env_error")
        traj.error = error
        return traj

    trajs = [_traj("a", 1.0), lost("environment node lost: node 5f3a left the cluster during this episode (...)"),
             lost("environment node lost: node 5f3a left the cluster during this episode (...)"),
             lost("environment worker actor died: The actor died unexpectedly before finishing this task."),
             lost("worker process died (exit code -9)"), lost("environment call timed out after 120 s"),
             lost("EnvError: the screen is one colour (0, 0, 0)\nTraceback ...")]
    m = rollout_metrics(["a"], trajs, [])
    assert m["env_errors"] == 6
    assert m["env_error_causes"] == {"node_lost": 2, "actor_died": 1, "worker_died": 1, "timeout": 1,
                                     "environment": 1}
    assert rollout_metrics(["a"], trajs[:1], [])["env_error_causes"] == {}


def test_replay_ages_and_importance_weights():
    groups = [Group("a", [_traj("a", 1.0, replayed=True, version=2), _traj("a", 0.0, version=5)], [1.0, -1.0],
                    injected=True, all_failed=True)]
    assert replay_ages(groups, weights_version=5) == {"replay_age_mean": 3.0, "replay_age_max": 3}
    assert weight_stats([], cap=2.0) == {}
    stats = weight_stats([torch.tensor([0.5, 2.0]), torch.tensor([1.0, 2.0])], cap=2.0)
    assert stats == {"is_weight_mean": 1.375, "is_weight_max": 2.0, "is_capped_share": 0.5}


def test_an_update_counts_only_the_steps_it_took():
    stats = UpdateMetrics(sequences=6, groups=[], weights_version=0)
    stats.minibatch([0.5, 0.1, 0.01, 0.0], ran=True, norm=2.0, tokens=40)
    stats.minibatch([9.0, 0.3, 0.03, 0.0], ran=True, norm=math.nan, tokens=50)  # skipped: no loss, no norm
    stats.minibatch([0.0, 0.0, 0.0, 0.0], ran=False, norm=1.0, tokens=10)  # nothing of it ran here
    r = stats.result()
    assert (r["optimizer_steps"], r["skipped_steps"], r["tokens"], r["sequences"]) == (2, 1, 50, 6)
    assert r["loss"] == pytest.approx(0.25) and r["grad_norm"] == pytest.approx(1.5)
    assert r["clip_fraction"] == pytest.approx(0.2) and r["approx_kl"] == pytest.approx(0.02)
    empty = UpdateMetrics(sequences=0, groups=[], weights_version=0).result()
    assert empty["loss"] == 0.0 and empty["optimizer_steps"] == 0


def test_a_step_line_keeps_its_field_order():
    update = UpdateMetrics(sequences=0, groups=[], weights_version=0).result()
    line = step_metrics(3, ["a"], [_traj("a", 1.0)], [], replay_size=2, env_steps=10, lr=1e-6, update=update,
                        seconds_rollout=2.0, seconds_update=1.23456, extra={"eval_success_rate": 0.5})
    assert list(line) == [
        "step", "tasks", "success_rate", "success_by_task", "mean_task_score", "mean_reward", "format_error_rate",
        "mean_steps", "env_errors", "env_error_causes", "setup_failed", "setup_failures", "checker_errors", "all_failed_groups",
        "replay_injections", "replay_size",
        "env_steps", "env_steps_per_s", "lr", "loss", "clip_fraction", "grad_norm", "tokens", "sequences",
        "optimizer_steps", "skipped_steps", "approx_kl", "kl", "replay_age_mean", "replay_age_max",
        "seconds_rollout", "seconds_update", "eval_success_rate"]
    assert line["env_steps_per_s"] == 5.0 and line["seconds_update"] == 1.235
