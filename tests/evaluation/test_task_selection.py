"""Task selection (ARPO's filtering): counts, the keep rule, infrastructure retries, resume, and
one real run through MiniWoB++ with the tiny model."""
from __future__ import annotations

import json

import pytest
import yaml

from arpo_lib.types import Trajectory
from arpo_lib.evaluation.task_selection import load_selection, select_tasks


class FakeEngine:
    """Stands in for RolloutEngine: outcomes come from `outcome(task, sample, seed)`."""

    def __init__(self, outcome, workers=4, crash_after=None):
        self.pool = [None] * workers
        self.outcome = outcome
        self.crash_after = crash_after
        self.runs: list[tuple[str, int, int]] = []

    def run(self, requests, *, temperature, progress, description, out_dir, on_finish):
        for req in requests:
            if self.crash_after is not None and len(self.runs) >= self.crash_after:
                raise KeyboardInterrupt("killed")
            self.runs.append((req.task, req.sample, req.seed))
            status, score = self.outcome(req.task, req.sample, req.seed)
            traj = Trajectory(task=req.task, seed=req.seed, sample=req.sample, task_score=score, status=status)
            on_finish(traj)
        return []


def _by_rule(task, sample, seed):
    # task a: solved twice in 4; task b: never; task c: always
    score = {"x/a": float(sample in (1, 3)), "x/b": 0.0, "x/c": 1.0}[task]
    return "ok", score


def test_counts_keep_rule_and_files(tmp_path):
    res = select_tasks(FakeEngine(_by_rule), ["x/a", "x/b", "x/c"], tmp_path, k=4, progress=False)
    counts = {t.task: (t.successes, t.samples, t.kept) for t in res.tasks}
    assert counts == {"x/a": (2, 4, True), "x/b": (0, 4, False), "x/c": (4, 4, True)}
    assert res.kept == ["x/a", "x/c"]
    assert res.success_rate == pytest.approx(6 / 12)
    assert load_selection(tmp_path) == ["x/a", "x/c"]
    assert load_selection(tmp_path / "kept_tasks.yaml") == ["x/a", "x/c"]
    assert yaml.safe_load((tmp_path / "kept_tasks.yaml").read_text()) == {"env": {"tasks": ["x/a", "x/c"]}}
    md = (tmp_path / "selection.md").read_text()
    assert "| x | 3 | 2 | 0.67 | 0.50 |" in md  # per-domain row
    assert "| x/b | 0 / 4 | 0 | no |" in md
    # min_successes=3 keeps only the always-solved task
    res3 = select_tasks(FakeEngine(_by_rule), ["x/a", "x/b", "x/c"], tmp_path / "m3", k=4, min_successes=3,
                        progress=False)
    assert res3.kept == ["x/c"]
    # max_successes (a study of replay: tasks solved rarely) drops the always-solved one
    rare = select_tasks(FakeEngine(_by_rule), ["x/a", "x/b", "x/c"], tmp_path / "rare", k=4, max_successes=2,
                        progress=False)
    assert rare.kept == ["x/a"] and rare.to_dict()["max_successes"] == 2
    assert "kept when successes >= 1 and <= 2 " in (tmp_path / "rare" / "selection.md").read_text()
    assert "and <=" not in md


def test_infrastructure_failures_are_rerun_not_counted(tmp_path):
    failed_once: set[tuple[str, int]] = set()

    def flaky(task, sample, seed):
        if sample % 2 == 0 and (task, sample) not in failed_once:
            failed_once.add((task, sample))
            return "env_error", 0.0
        return "ok", 0.0

    engine = FakeEngine(flaky)
    res = select_tasks(engine, ["x/a", "x/b"], tmp_path, k=4, progress=False)
    assert [(t.samples, t.env_errors, t.kept) for t in res.tasks] == [(4, 2, False), (4, 2, False)]
    # the re-run of a lost episode uses a fresh seed
    seeds = {}
    for task, sample, seed in engine.runs:
        seeds.setdefault((task, sample), []).append(seed)
    assert all(len(set(s)) == len(s) for s in seeds.values())
    assert len(engine.runs) == 8 + 4

    def always_broken(task, sample, seed):
        return "env_error", 0.0

    res = select_tasks(FakeEngine(always_broken), ["x/a"], tmp_path / "broken", k=2, max_env_retries=1,
                       progress=False)
    assert res.incomplete == ["x/a"] and res.tasks[0].env_errors == 4 and not res.kept


def test_resume_after_a_crash_repeats_nothing(tmp_path):
    tasks = ["x/a", "x/b", "x/c"]
    with pytest.raises(KeyboardInterrupt):
        select_tasks(FakeEngine(_by_rule, crash_after=5), tasks, tmp_path, k=4, progress=False)
    assert len((tmp_path / "episodes.jsonl").read_text().splitlines()) == 5
    engine = FakeEngine(_by_rule)
    res = select_tasks(engine, tasks, tmp_path, k=4, progress=False)
    assert len(engine.runs) == 12 - 5
    reference = select_tasks(FakeEngine(_by_rule), tasks, tmp_path / "ref", k=4, progress=False)
    assert json.loads((tmp_path / "selection.json").read_text())["tasks"] == \
        json.loads((tmp_path / "ref" / "selection.json").read_text())["tasks"]
    assert res.kept == reference.kept
    # a resumed selection with another protocol is refused instead of mixing counts
    with pytest.raises(ValueError, match="holds a selection"):
        select_tasks(FakeEngine(_by_rule), tasks, tmp_path, k=8, progress=False)


def test_bad_arguments():
    with pytest.raises(ValueError):
        select_tasks(FakeEngine(_by_rule), ["x/a"], "/tmp/never", k=2, min_successes=3, progress=False)
    with pytest.raises(ValueError, match="max_successes"):
        select_tasks(FakeEngine(_by_rule), ["x/a"], "/tmp/never", k=4, min_successes=2, max_successes=1, progress=False)
    with pytest.raises(FileNotFoundError, match="select-tasks"):
        load_selection("/nonexistent/selection")


@pytest.mark.slow
def test_real_selection_with_miniwob(tiny_qwen2vl, chromium_available, tmp_path, monkeypatch):
    """The workflow end to end: the scripted agent solves click-test, the random tiny model
    fails click-button; k=2 keeps exactly the first, and the config file it writes loads."""
    from arpo_lib import workflows
    from arpo_lib.run.config import load_config
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.agent.scripted import ScriptedPolicy

    cfg = load_config(None, [f"model.path={tiny_qwen2vl}", "env.workers=2", "env.max_steps=3",
                             "env.options={scale: 2}", "select.k=2", f"out_dir={tmp_path}", "name=sel",
                             "model.max_new_tokens=16", "logging.progress=false",
                             "env.tasks=[miniwob/click-test, miniwob/click-button]"])
    base = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=16)

    class Mixed(ScriptedPolicy):
        """Scripted on click-test, the random model elsewhere."""

        def generate(self, segments, *, contexts=None, seeds=None, **kw):
            out = []
            for i, (seg, ctx) in enumerate(zip(segments, contexts)):
                solver = super().generate if ctx.task == "miniwob/click-test" else self.base.generate
                out += solver([seg], contexts=[ctx], seeds=None if seeds is None else [seeds[i]], **kw)
            return out

    monkeypatch.setattr("arpo_lib.build.HFPolicy", lambda *a, **k: Mixed(base))
    res = workflows.run_task_selection(cfg)
    assert [(t.task, t.samples, t.successes) for t in res.tasks] == \
        [("miniwob/click-test", 2, 2), ("miniwob/click-button", 2, 0)]
    assert res.kept == ["miniwob/click-test"]
    kept = tmp_path / "sel" / "selection" / "kept_tasks.yaml"
    assert load_config(kept).env.tasks == ["miniwob/click-test"]


def test_selection_plot(tmp_path):
    from arpo_lib.viz.plots import plot_selection

    select_tasks(FakeEngine(_by_rule), ["x/a", "x/b", "x/c"], tmp_path, k=4, progress=False)
    fig = plot_selection(tmp_path)
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.patches] == [2, 0, 4]
    assert fig._repr_png_().startswith(b"\x89PNG")
