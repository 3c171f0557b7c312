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


class _Engine:
    """Plays each request at once: a success where (sample + len(task)) is even; the first attempt
    at (miniwob/b, 1) is lost to the environment (a rerun pass plays it again)."""

    def __init__(self):
        self.env_steps, self.played = 0, []

    def run(self, requests, **_):
        out = []
        for r in requests:
            lost = (r.task, r.sample) == ("miniwob/b", 1) and (r.task, r.sample) not in self.played
            self.played.append((r.task, r.sample))
            t = _traj(r.task, float((r.sample + len(r.task)) % 2 == 0), status="env_error" if lost else "ok",
                      steps=1 + r.sample)
            t.seed, t.sample = r.seed, r.sample
            self.env_steps += len(t.steps)
            out.append(t)
        return out


class _Spread:
    """Rank `rank` of `world` threads, exchanging their lists through a barrier."""

    def __init__(self, rank, world, board, barrier):
        self.rank, self.world, self.board, self.barrier = rank, world, board, barrier
        self.is_main = rank == 0

    def share(self, items):
        return list(items[self.rank::self.world])

    def gather_lists(self, mine):
        self.board[self.rank] = mine
        self.barrier.wait()
        return [self.board[r] for r in range(self.world)]


def test_an_evaluation_spread_over_ranks_sums_up_as_one_process_and_each_plays_its_share(tmp_path):
    """Two ranks (threads), each on its own engine: every rank gets the one process's summary
    (reruns pass by pass and environment steps summed), only rank 0 writes it, and each rank
    played its own share."""
    import json
    import threading

    from arpo_lib.evaluation.evaluate import evaluate

    tasks, kwargs = ["miniwob/a", "miniwob/b", "miniwob/cc"], dict(samples_per_task=3, rerun_passes=1, progress=False)
    alone = evaluate(_Engine(), tasks, **kwargs).to_dict()
    board, barrier, results, engines = {}, threading.Barrier(2), {}, {0: _Engine(), 1: _Engine()}

    def rank(r):
        results[r] = evaluate(engines[r], tasks, out_dir=tmp_path / f"rank{r}", spread=_Spread(r, 2, board, barrier),
                              **kwargs).to_dict()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert alone["rerun"] == [{"pass": 1, "episodes": 1, "still_without_result": 0}]
    for r in (0, 1):
        got = dict(results[r])
        assert got.pop("episodes_by_rank") == [6, 4]  # 9 episodes (5 and 4), and rank 0 reruns its lost one
        assert {k: v for k, v in got.items() if k != "seconds"} == \
            {k: v for k, v in alone.items() if k not in ("seconds", "episodes_by_rank")}
    assert (tmp_path / "rank0" / "results.json").is_file() and not (tmp_path / "rank1").exists()
    assert json.loads((tmp_path / "rank0" / "results.json").read_text())["episodes_by_rank"] == [6, 4]
    assert sorted(engines[0].played + engines[1].played) == sorted([
        (t, s) for t in tasks for s in range(3)] + [("miniwob/b", 1)])
    assert engines[0].played[:5] == [("miniwob/a", 0), ("miniwob/a", 2), ("miniwob/b", 1), ("miniwob/cc", 0),
                                     ("miniwob/cc", 2)]
