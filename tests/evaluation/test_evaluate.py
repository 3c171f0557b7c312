"""Evaluation statistics (pure) on hand-made trajectories."""
from __future__ import annotations

import pytest

from arpo_lib.evaluation.evaluate import pass_at_k, summarize
from arpo_lib.types import StepRecord, Trajectory


def _traj(task, score, fmt=True, status="ok", steps=2):
    t = Trajectory(task=task, seed=0, sample=0, task_score=score, format_ok=fmt, status=status)
    t.steps = [StepRecord(i + 1, "", [], None, 0.0, False, False, 0.0) for i in range(steps)]
    return t


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - (2 / 4) * (1 / 3))


def test_summarize_excludes_infrastructure_failures():
    trajs = [_traj("miniwob/a", 1.0), _traj("miniwob/a", 0.0, fmt=False, steps=1), _traj("miniwob/a", 0.0, status="env_error"),
             _traj("miniwob/b", 0.0), _traj("miniwob/b", 0.0)]
    r = summarize(trajs, k=2)
    a, b = r.tasks
    assert (a.samples, a.successes, a.env_errors) == (2, 1, 1)
    assert a.success_rate == 0.5 and a.pass_at_k == 1.0 and a.format_error_rate == 0.5 and a.mean_steps == 1.5
    assert b.success_rate == 0.0 and b.pass_at_k == 0.0
    assert r.success_rate == pytest.approx(1 / 4) and r.pass_at_k == 0.5 and r.env_errors == 1
    assert r.per_domain == {"miniwob": pytest.approx(0.25)}
    assert "miniwob/a" in r.table()


@pytest.mark.slow
def test_scripted_agent_as_the_upper_bound_baseline(tiny_qwen2vl, chromium_available, tmp_path):
    """`eval.policy=scripted`: the DOM-reading agent acts (an upper bound on its tasks); the
    random tiny model alone solves nothing."""
    from arpo_lib.run.config import ConfigError, load_config
    from arpo_lib.workflows import run_evaluation

    base = [f"model.path={tiny_qwen2vl}", "env.tasks=[miniwob/click-test, miniwob/enter-text]", "env.max_steps=6",
            "env.options={scale: 2}", "eval.samples_per_task=2", "logging.progress=false", "eval.osworld_results=false"]
    scripted = run_evaluation(load_config(None, base + ["eval.policy=scripted"]), tmp_path / "scripted")
    assert scripted.success_rate == 1.0 and scripted.episodes == 4
    with pytest.raises(ConfigError, match="eval.policy"):
        load_config(None, base + ["eval.policy=scripted", "rollout.backend=server"])
