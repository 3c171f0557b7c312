"""The ARPO-vs-GRPO comparison: its report arithmetic on hand-made runs, its config checks, and
one tiny end-to-end run (every stage, then a rerun that repeats nothing)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from arpo_lib.experiments import comparison_report
from arpo_lib.run.config import ConfigError, load_config
from arpo_lib.viz.report import report_digest, report_markdown


def _run(algo, seed, final, train, failed, injected, **extra):
    return {"algo": algo, "seed": seed, "seconds": 1.0,
            "eval": {"success_rate": final, "pass_at_k": final, "episodes": 16, "env_errors": 0, "format_error_rate": 0.0},
            "train_success": train, "all_failed_groups": failed, "replay_injections": injected, **extra}


def test_report_means_spread_and_gain():
    cfg = load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]", "compare.algos=[arpo, grpo]"])
    warm = {"success_rate": 0.25, "pass_at_k": 0.5, "episodes": 16, "env_errors": 0, "format_error_rate": 0.1}
    runs = [_run("arpo", 0, 0.5, [0.0, 0.25, 0.5, 0.75], [1, 0.5, 0.5, 0], [2, 1, 1, 0]),
            _run("grpo", 0, 0.25, [0.0, 0.0, 0.25, 0.25], [1, 1, 0.5, 0.5], [0, 0, 0, 0]),
            _run("arpo", 1, 0.75, [0.25, 0.25, 0.5, 1.0], [0.5, 0.5, 0, 0], [1, 1, 0, 0]),
            _run("grpo", 1, 0.25, [0.0, 0.25, 0.25, 0.5], [1, 0.5, 0.5, 0.5], [0, 0, 0, 0])]
    report = comparison_report(cfg, warm, runs, ["miniwob/click-test"])
    arpo, grpo = report["arms"]["arpo"], report["arms"]["grpo"]
    assert arpo["eval_success"]["mean"] == pytest.approx(0.625)
    assert arpo["eval_success"]["std"] == pytest.approx(0.1767767, rel=1e-6)  # Bessel's correction
    assert arpo["eval_gain_over_warm_start"]["mean"] == pytest.approx(0.375)
    assert arpo["train_success_last_quarter"]["mean"] == pytest.approx(0.875)  # last 1 of 4 steps
    assert arpo["all_failed_share"]["mean"] == pytest.approx(0.375)
    assert arpo["replay_injections"]["mean"] == pytest.approx(3.0)
    assert grpo["eval_success"] == {"mean": 0.25, "std": 0.0, "min": 0.25, "max": 0.25, "n": 2, "lo": 0.25, "hi": 0.25}
    assert arpo["eval_success"]["lo"] == 0.5 and arpo["eval_success"]["hi"] == 0.75  # bootstrap over 2 seeds
    # training success against the warm start (no training-temperature baseline given: the eval one)
    assert arpo["train_gain_over_warm_start"]["mean"] == pytest.approx(0.625)
    assert arpo["every_seed_gained_15_points"] and not grpo["every_seed_gained_15_points"]
    paired = report["paired"]["arpo-grpo"]["eval"]
    assert paired["differences"] == [0.25, 0.5] and paired["p_permutation"] == pytest.approx(0.5)
    md = report_markdown(report)
    assert "| ARPO | 2 | 0.625 [0.500, 0.750] | +0.375 | 0.125 → 0.875 |" in md
    assert "| ARPO − GRPO | final eval success | +0.375 [+0.250, +0.500] | 2 / 0 / 0 | 0.500 | 0.500 |" in md
    assert "arpo-s1: eval 0.750, injections 2" in report_digest(report)
    from arpo_lib.viz.plots import plot_comparison

    fig = plot_comparison(report)
    assert len(fig.axes) == 5 and fig._repr_png_().startswith(b"\x89PNG")


def test_three_arms_with_a_training_temperature_baseline():
    cfg = load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1, 2]"])
    warm = {"success_rate": 0.2, "pass_at_k": 0.5, "episodes": 16, "env_errors": 0, "format_error_rate": 0.1}
    warm_t1 = dict(warm, success_rate=0.1)
    runs = []
    for seed in range(3):
        runs += [_run("grpo", seed, 0.3, [0.1, 0.2, 0.2, 0.3], [1, 1, 0.5, 0.5], [0] * 4),
                 _run("arpo", seed, 0.4 + 0.1 * seed, [0.1, 0.3, 0.4, 0.5], [1, 0.5, 0.5, 0], [1, 1, 0, 0],
                      is_weight_mean=[], replay_age_mean=[2.0, 3.0]),
                 _run("arpo_tis", seed, 0.5, [0.1, 0.3, 0.4, 0.6], [1, 0.5, 0, 0], [1, 0, 0, 0],
                      is_weight_mean=[1.2, 0.8], is_capped_share=[0.1, 0.0], replay_age_mean=[2.0])]
    report = comparison_report(cfg, warm, runs, ["miniwob/click-test"], warm_train=warm_t1)
    tis, arpo = report["arms"]["arpo_tis"], report["arms"]["arpo"]
    assert tis["train_gain_over_warm_start"]["mean"] == pytest.approx(0.5)  # 0.6 - 0.1 in every seed
    assert tis["is_weight_mean"]["mean"] == pytest.approx(1.0) and "is_weight_mean" not in arpo
    assert arpo["replay_age_mean"]["mean"] == pytest.approx(2.5)
    assert set(report["paired"]) == {"arpo-grpo", "arpo_tis-arpo", "arpo_tis-grpo"}
    assert report["paired"]["arpo-grpo"]["eval"]["p_permutation"] == pytest.approx(0.25)  # 3 of 3 positive
    assert len(tis["curves"]["train_success"]) == 4
    assert "ARPO+TIS" in report_markdown(report)


def test_the_report_shows_the_regime_and_transfer():
    cfg = load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]", "compare.algos=[grpo, arpo]"])
    warm = {"success_rate": 0.25, "pass_at_k": 0.5, "episodes": 16, "env_errors": 0, "format_error_rate": 0.1}
    fresh = dict(warm, success_rate=0.1, episodes=8)
    runs = []
    for seed in (0, 1):
        runs += [_run("grpo", seed, 0.25, [0.0, 0.25, 0.5, 0.5], [1.0, 0.5, 0.5, 0.0], [0, 0, 0, 0],
                      transfer={"success_rate": 0.2}, replay_age_by_step=[None] * 4),
                 _run("arpo", seed, 0.5, [0.0, 0.25, 0.5, 0.75], [1.0, 0.5, 0.5, 0.0], [4, 3, 3, 0],
                      transfer={"success_rate": 0.25 + 0.125 * seed}, replay_age_by_step=[1.0, 2.0, 4.0, None])]
    report = comparison_report(cfg, warm, runs, ["miniwob/click-test@0", "miniwob/click-test@1"],
                               warm_transfer=fresh)
    assert report["warm_start_transfer"]["tasks"] == ["miniwob/click-test"]
    arpo = report["arms"]["arpo"]
    assert arpo["transfer_gain_over_warm_start"]["mean"] == pytest.approx(0.2125)
    assert arpo["regime"]["all_failed_first_half"]["mean"] == 0.75 and arpo["regime"]["injections_per_run"]["mean"] == 10
    md = report_markdown(report)
    assert "| ARPO | 0.75 [0.75, 0.75] | 10.0 [10.0, 10.0] | 10-10 | yes |" in md
    assert "| GRPO | 0.75 [0.75, 0.75] | 0.0 [0.0, 0.0] | 0-0 | yes (no replay: all-failed share only) |" in md
    assert "| step | GRPO all-failed | ARPO all-failed | inj. | age |" in md and "| 3 | 0.50 | 0.50 | 3.00 | 4.0 |" in md
    assert "| 4 | 0.00 | 0.00 | 0.00 | – |" in md
    assert "warm start **0.100**" in md and "| ARPO | 2 | 0.312 [0.250, 0.375] | +0.213 [+0.150, +0.275] |" in md
    assert "| ARPO − GRPO | fresh layouts (transfer) | +0.112 [+0.050, +0.175] | 2 / 0 / 0 | 0.500 | 0.500 | 26 |" in md


def test_per_instance_curves_line_up_visits_not_steps():
    """Batches draw a few instances per step, so seed 0 may visit an instance at steps 1 and 3 and
    seed 1 at steps 2 and 3: the curve averages the k-th visits, then the final policy."""
    from arpo_lib.viz.plots import instance_curves, plot_instance_curves

    a, b = "miniwob/click-test@0", "miniwob/click-test@1"
    runs = [_run("arpo", 0, 0.5, [0.1, 0.2, 0.3], [1, 0, 0], [0, 1, 0],
                 train_success_by_task=[{a: [0, 8]}, {b: [4, 8]}, {a: [2, 8], b: [8, 8]}],  # as recorded
                 final_train_t={"success_rate": 0.5, "by_task": {a: 0.5, b: 0.75}}),
            _run("arpo", 1, 0.5, [0.1, 0.2, 0.3], [1, 0, 0], [0, 1, 0],
                 train_success_by_task=[{b: 0.25}, {a: 0.5}, {a: 0.75}],
                 final_train_t={"success_rate": 0.5, "by_task": {a: 0.25, b: 0.25}}),
            _run("grpo", 0, 0.5, [0.1, 0.2, 0.3], [1, 0, 0], [0, 0, 0],
                 train_success_by_task=[{a: 0.125}, {}, {}])]
    report = {"tasks": [a, b], "arms": {"arpo": {}, "grpo": {}}, "runs": runs,
              "warm_start_train_by_task": {a: 0.1, b: 0.2}}
    curves = instance_curves(report)
    assert curves[a]["arpo"] == [{"visit": 1, "mean": 0.25, "n": 2}, {"visit": 2, "mean": 0.5, "n": 2},
                                 {"visit": "final", "mean": 0.375, "n": 2}]
    assert curves[b]["arpo"] == [{"visit": 1, "mean": 0.375, "n": 2}, {"visit": 2, "mean": 1.0, "n": 1},
                                 {"visit": "final", "mean": 0.5, "n": 2}]
    assert curves[a]["grpo"] == [{"visit": 1, "mean": 0.125, "n": 1}] and curves[b]["grpo"] == []
    fig = plot_instance_curves(report, columns=1)
    assert [ax.get_title() for ax in fig.axes] == ["click-test@0", "click-test@1"]
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_the_seeded_arm_points_at_the_selection_trajectories(tmp_path):
    from arpo_lib.experiments import run_config, transfer_tasks

    cfg = load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}", "name=exp"])
    with pytest.raises(RuntimeError, match="selection was made without keeping its trajectories"):
        run_config(cfg, "arpo_seeded", 0, tmp_path / "model", ["miniwob/click-test"])
    (tmp_path / "exp" / "selection" / "trajectories").mkdir(parents=True)
    seeded = run_config(cfg, "arpo_seeded", 0, tmp_path / "model", ["miniwob/click-test"])
    assert seeded.algo.replay.seed_from == str(tmp_path / "exp" / "selection" / "trajectories")
    assert seeded.algo.replay.enabled and seeded.algo.replay.correction == "none"
    assert run_config(cfg, "arpo", 0, tmp_path / "model", ["miniwob/click-test"]).algo.replay.seed_from is None
    assert transfer_tasks(["miniwob/click-test@0", "miniwob/click-test@3", "miniwob/focus-text-2@1",
                           "miniwob/click-button"]) == ["miniwob/click-test", "miniwob/focus-text-2", "miniwob/click-button"]


def test_transfer_evaluates_fresh_layouts_even_where_the_experiment_expands_instances(tmp_path):
    """configs/replay_regime.yaml sets env.instances_per_task=2 for its warm start; an evaluation of
    `miniwob/click-test-2` must not become one of `click-test-2@0` / `@1` (a first probe's did)."""
    from arpo_lib import build
    from arpo_lib.experiments import eval_config, transfer_tasks

    cfg = load_config("configs/replay_regime.yaml", [f"out_dir={tmp_path}"])
    kept = ["miniwob/click-test-2@2", "miniwob/focus-text-2@1", "miniwob/focus-text-2@3"]
    fresh = build.resolve_task_sets(eval_config(cfg, tmp_path / "m", transfer_tasks(kept), tmp_path / "eval_transfer"))
    assert fresh.env.tasks == ["miniwob/click-test-2", "miniwob/focus-text-2"]
    fixed = build.resolve_task_sets(eval_config(cfg, tmp_path / "m", kept, tmp_path / "eval_final_t", temperature=1.0))
    assert fixed.env.tasks == kept and fixed.eval.temperature == 1.0


def test_compare_config_is_checked():
    with pytest.raises(ConfigError, match="compare.algos"):
        load_config(None, ["compare.algos=[ppo]"])
    with pytest.raises(ConfigError, match="compare.seeds"):
        load_config(None, ["compare.seeds=[1, 1]"])


@pytest.mark.slow
@pytest.mark.long  # the stages themselves: test_a_seed_reproduces_bit_for_bit
def test_tiny_comparison_end_to_end_and_rerun_repeats_nothing(tmp_path, tiny_qwen2vl, chromium_available):
    """The first run goes through notebooks/arpo_vs_grpo.ipynb headlessly (its nbval re-execution at
    the committed defaults is a long test): the notebook's cells and the library's stages at once."""
    from arpo_lib.experiments import run_comparison
    from arpo_lib.run import layout
    from arpo_lib.workflows import execute_notebook

    cfg_args = [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=exp", "compare.seeds=[0]", "train.steps=1",
                "eval.samples_per_task=1", "env.tasks=[miniwob/click-test, miniwob/click-button]",
                "warm_start.steps=100"]
    cfg = load_config("configs/learning_miniwob_short.yaml", cfg_args)
    executed = execute_notebook("notebooks/arpo_vs_grpo.ipynb",
                                {"config": "configs/learning_miniwob_short.yaml", "overrides": cfg_args},
                                run_name="exp", out_dir=tmp_path)
    nb = json.loads(executed.read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "warm start eval" in text and "| GRPO |" in text
    assert [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    report = json.loads((tmp_path / "exp" / "report.json").read_text())
    exp = tmp_path / "exp"
    for path in ("warm_start/model/config.json", "selection/selection.json", "eval_warm_start/results.json",
                 "eval_warm_start_train/results.json", "arpo-s0/final.json", "grpo-s0/final.json",
                 "arpo_tis-s0/final.json", "report.md", "comparison.png", "instances.png"):
        assert (exp / path).exists(), path
    assert [r["algo"] for r in report["runs"]] == ["grpo", "arpo", "arpo_tis"]
    # the training-temperature baseline has its own, larger sample (compare.baseline_samples_per_task)
    baseline = json.loads((exp / "eval_warm_start_train" / "results.json").read_text())
    assert baseline["episodes"] == len(report["tasks"]) * cfg.compare.baseline_samples_per_task == 2 * len(report["tasks"])
    # both arms started from the same weights, tasks and seeds: their first rollouts are identical
    def first_batch(arm):  # every step of every episode, wall-clock times left out
        root = exp / arm / "rollouts" / "step_000000"
        return {str(p.relative_to(root)): [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                                           for line in p.read_text().splitlines()]
                for p in sorted(root.rglob("traj.jsonl"))}

    assert first_batch("arpo-s0") == first_batch("grpo-s0") != {}

    def seeds(d):
        return sorted(json.loads(m.read_text())["seed"] for m in d.rglob("meta.json"))

    assert json.loads((exp / "grpo-s0" / "final.json").read_text())["replay_injections"] == [0]
    mtimes = {p: p.stat().st_mtime for p in exp.rglob("metrics.jsonl")}
    again = run_comparison(cfg)
    assert again["arms"] == report["arms"]
    assert {p: p.stat().st_mtime for p in exp.rglob("metrics.jsonl")} == mtimes  # nothing was rerun
    # The final policy at the training temperature and on fresh layouts (transfer), turned on after
    # the runs finished: measured once per run (the training temperature: on the baseline's
    # episodes), recorded in final.json, nothing retrained. And a fourth arm joins: ARPO with its
    # buffer seeded by the successes task selection found.
    (exp / "report.md").unlink()
    with_final = load_config("configs/learning_miniwob_short.yaml", [
        *cfg_args, "compare.final_at_train_temperature=true", "compare.transfer_samples_per_task=1",
        "compare.algos=[grpo, arpo, arpo_tis, arpo_seeded]"])
    measured = run_comparison(with_final)
    assert {p: mtimes[p] for p in mtimes} == {p: p.stat().st_mtime for p in mtimes}
    assert [r["algo"] for r in measured["runs"]] == ["grpo", "arpo", "arpo_tis", "arpo_seeded"]
    found = [json.loads(m.read_text()) for m in (exp / "selection" / "trajectories").rglob("meta.json")]
    kept_successes = sum(t["task"] in report["tasks"] and t["task_score"] > 0.1 for t in found)
    episodes = (exp / "selection" / layout.SELECTION_LOG).read_text().splitlines()
    assert len(found) == len(episodes) and kept_successes >= 1  # every selection episode kept its trajectory

    def replay_size(arm):  # after the first step: the fresh successes (+ the seeded ones)
        return json.loads((exp / arm / "metrics.jsonl").read_text().splitlines()[0])["replay_size"]

    assert first_batch("arpo_seeded-s0") == first_batch("arpo-s0")
    assert replay_size("arpo_seeded-s0") == replay_size("arpo-s0") + kept_successes
    warm_transfer = json.loads((exp / "eval_transfer" / "results.json").read_text())
    assert warm_transfer["episodes"] == len(report["tasks"])  # 1 episode per task, fresh layouts
    assert measured["warm_start_transfer"]["success_rate"] == warm_transfer["success_rate"]
    for run in measured["runs"]:
        transfer = json.loads((exp / f"{run['algo']}-s0" / "eval_transfer" / "results.json").read_text())
        assert run["transfer"]["success_rate"] == transfer["success_rate"]
        assert seeds(exp / f"{run['algo']}-s0" / "eval_transfer") == seeds(exp / "eval_transfer") != []
    assert "transfer" in measured["paired"]["arpo_seeded-arpo"]
    assert "Transfer: success on fresh layouts" in (exp / "report.md").read_text()
    for run in measured["runs"]:
        final_t = json.loads((exp / f"{run['algo']}-s0" / "eval_final_t" / "results.json").read_text())
        assert final_t["episodes"] == baseline["episodes"]
        assert run["final_train_t"]["success_rate"] == final_t["success_rate"]
        assert sorted(run["final_train_t"]["by_task"]) == sorted(report["tasks"])
        assert json.loads((exp / f"{run['algo']}-s0" / "final.json").read_text())["final_train_t"] == run["final_train_t"]
        # the same episodes as the warm start's baseline (paired): same task seeds, episode by episode
        assert seeds(exp / f"{run['algo']}-s0" / "eval_final_t") == seeds(exp / "eval_warm_start_train") != []
    assert "final_gain_over_warm_start" in measured["arms"]["grpo"]
    assert "| GRPO | final policy |" in (exp / "report.md").read_text()
    # compare.archive: the finished runs' records, the report and the stages' fingerprint go into a
    # directory one can commit; elsewhere (a fresh checkout: no run directory) the same command
    # makes the stages again, finds them the same, and restores the runs instead of running them
    archive = tmp_path / "archive"
    final_args = [*cfg_args, "compare.final_at_train_temperature=true", "compare.transfer_samples_per_task=1",
                  "compare.algos=[grpo, arpo, arpo_tis, arpo_seeded]", f"compare.archive={archive}"]
    run_comparison(load_config("configs/learning_miniwob_short.yaml", final_args))
    assert sorted(p.name for p in archive.iterdir()) == sorted(
        ["stages.json", "report.json", "report.md", "comparison.png", "instances.png", "grpo-s0", "arpo-s0", "arpo_tis-s0", "arpo_seeded-s0"])
    assert {p: mtimes[p] for p in mtimes} == {p: p.stat().st_mtime for p in mtimes}
    elsewhere = load_config("configs/learning_miniwob_short.yaml", [*final_args, f"out_dir={tmp_path}/elsewhere"])
    restored = run_comparison(elsewhere)
    assert restored["arms"] == measured["arms"] and restored["paired"] == measured["paired"]
    assert (elsewhere.run_dir / "warm_start" / "model").is_dir()  # made again, and found the same
    assert not list(elsewhere.run_dir.rglob("metrics.jsonl"))  # no run was run again
    # --report-only: the finished runs' report, nothing run, the missing runs named
    (exp / "arpo_tis-s0" / "final.json").unlink()
    partial = run_comparison(cfg, report_only=True)
    assert partial["missing_runs"] == ["arpo_tis-s0"] and "arpo_tis" not in partial["arms"]
    transfer_keys = ("transfer_success", "transfer_gain_over_warm_start")
    assert partial["arms"]["arpo"] == {k: v for k, v in measured["arms"]["arpo"].items() if k not in transfer_keys}
    assert not (exp / "arpo_tis-s0" / "final.json").exists()
    assert "Partial report: 1 run(s) not finished** (arpo_tis-s0)" in (exp / "report.md").read_text()
    assert {p: mtimes[p] for p in mtimes} == {p: p.stat().st_mtime for p in mtimes}
    empty = load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}", "name=nothing-yet"])
    with pytest.raises(RuntimeError, match="nothing to report.*stages not finished"):
        run_comparison(empty, report_only=True)


_TIMING = ("seconds", "time", "wall", "elapsed", "started", "finished", "per_s", "duration", "created")


def _run_digest(root: Path, out_dir: Path) -> dict[str, Any]:
    """Every file of an experiment directory: JSON with wall-clock fields left out and `out_dir`
    written as <out>, other files by their bytes (weights, token ids and log-probs, screenshots).
    Logs and report.md (wall times in its table; report.json holds the same numbers) are left out."""
    import hashlib

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if not any(t in k.lower() for t in _TIMING)}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    digest: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if path.suffix == ".log" or path.name == "report.md":
            continue
        text = path.read_bytes()
        if path.suffix in (".json", ".jsonl", ".yaml"):
            text = text.replace(str(out_dir).encode(), b"<out>")
        if path.name == "manifest.json":  # checkpoint file sizes; trainer_state.json's holds wall times
            digest[rel] = {k: v for k, v in json.loads(text).items() if k != "trainer_state.json"}
        elif path.suffix == ".json":
            digest[rel] = strip(json.loads(text))
        elif path.suffix == ".jsonl":
            digest[rel] = [strip(json.loads(line)) for line in text.decode().splitlines() if line.strip()]
        else:
            digest[rel] = hashlib.sha256(text).hexdigest()
    return digest


@pytest.mark.slow
def test_a_seed_reproduces_bit_for_bit(tmp_path, tiny_qwen2vl, chromium_available):
    """Warm start, selection, training and evaluation twice from nothing with the same seeds: every
    weight, token, log-probability, screenshot and number is the same (a regression test: a fresh clone's
    warm start and selection once differed from the committed ones)."""
    from arpo_lib.experiments import run_comparison

    digests = []
    for attempt in ("a", "b"):  # same length: file sizes in checkpoint manifests hold the path
        out = tmp_path / attempt
        cfg = load_config("configs/learning_miniwob_short.yaml", [
            f"model.path={tiny_qwen2vl}", f"out_dir={out}", "name=exp", "compare.seeds=[0]",
            "compare.algos=[arpo_tis]", "train.steps=2", "eval.samples_per_task=1", "warm_start.steps=100",
            "compare.final_at_train_temperature=false", "warm_start.demos_per_task=2",
            "env.tasks=[miniwob/click-test, miniwob/login-user]"])
        run_comparison(cfg)
        digests.append(_run_digest(out / "exp", out))
    first, second = digests
    assert any(k.endswith("model.safetensors") for k in first) and any("step_000001" in k for k in first)
    differing = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
    assert differing == [], differing[:20]


def test_training_gain_is_taken_task_by_task():
    """A batch draws two tasks per step, so a quarter's raw success rate depends on which tasks
    it happened to draw: here the last quarter trained mostly on the easy task and its raw rate
    rose though no task improved. The report compares each task with its own warm-start rate."""
    cfg = load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0]", "compare.algos=[arpo]"])
    tasks = [{"task": "easy", "success_rate": 0.8}, {"task": "hard", "success_rate": 0.2}]
    warm = {"success_rate": 0.5, "pass_at_k": 1.0, "episodes": 20, "env_errors": 0, "format_error_rate": 0.0,
            "tasks": tasks}
    # 4 steps; the last (the last quarter) draws easy twice as often as hard: raw 0.6, no task gained.
    by_task = [{"easy": [4, 5], "hard": [1, 5]}] * 3 + [{"easy": [8, 10], "hard": [1, 5]}]
    flat = _run("arpo", 0, 0.5, [0.5, 0.5, 0.5, 0.6], [0] * 4, [0] * 4, train_success_by_task=by_task)
    report = comparison_report(cfg, warm, [flat], ["easy", "hard"], warm_train=warm)
    arm = report["arms"]["arpo"]
    assert arm["train_gain_over_warm_start"]["mean"] == pytest.approx(0.0)  # (0.8-0.8 + 0.2-0.2) / 2
    assert arm["train_success_last_quarter"]["mean"] == pytest.approx(0.5)  # tasks weighted equally
    assert arm["train_last_quarter_by_task"] == {"easy": pytest.approx(0.8), "hard": pytest.approx(0.2)}
    # A real gain on one task is seen as half of it over two tasks.
    gained = [{"easy": [4, 5], "hard": [1, 5]}] * 3 + [{"easy": [8, 10], "hard": [3, 5]}]
    report = comparison_report(cfg, warm, [dict(flat, train_success_by_task=gained)], ["easy", "hard"],
                               warm_train=warm)
    assert report["arms"]["arpo"]["train_gain_over_warm_start"]["mean"] == pytest.approx(0.2)  # (0 + 0.4) / 2
    md = report_markdown(report)
    assert "| hard | 0.200 | 0.600 |" in md and "| easy | 0.800 | 0.800 |" in md
    # Records without per-task numbers (older runs) fall back to the raw rates.
    old = comparison_report(cfg, warm, [_run("arpo", 0, 0.5, [0.5, 0.5, 0.5, 0.6], [0] * 4, [0] * 4)],
                            ["easy", "hard"], warm_train=warm)
    assert old["arms"]["arpo"]["train_gain_over_warm_start"]["mean"] == pytest.approx(0.1)


def test_final_policy_gain_is_taken_task_by_task_and_flags_every_seed():
    """compare.final_at_train_temperature: each run's final policy on the training tasks with the
    baseline's episodes; its gain is per task, averaged; a seed under +0.15 is named and bold."""
    cfg = load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]", "compare.algos=[grpo]"])
    warm = {"success_rate": 0.5, "pass_at_k": 1.0, "episodes": 20, "env_errors": 0, "format_error_rate": 0.0,
            "tasks": [{"task": "a", "success_rate": 0.1}, {"task": "b", "success_rate": 0.5}]}
    by_task = [{"a": [1, 4], "b": [3, 4]}] * 4

    def final(a, b):
        return {"success_rate": (a + b) / 2, "pass_at_k": 1.0, "episodes": 20, "env_errors": 0,
                "format_error_rate": 0.0, "by_task": {"a": a, "b": b}}

    runs = [_run("grpo", 0, 0.5, [0.5] * 4, [0] * 4, [0] * 4, train_success_by_task=by_task,
                 final_train_t=final(0.6, 0.9)),   # +0.5, +0.4 -> +0.45
            _run("grpo", 1, 0.5, [0.5] * 4, [0] * 4, [0] * 4, train_success_by_task=by_task,
                 final_train_t=final(0.2, 0.6))]   # +0.1, +0.1 -> +0.10
    report = comparison_report(cfg, warm, runs, ["a", "b"], warm_train=warm)
    arm = report["arms"]["grpo"]
    assert arm["final_gains_by_seed"] == pytest.approx([0.45, 0.10])
    assert arm["final_gain_over_warm_start"]["mean"] == pytest.approx(0.275)
    assert not arm["every_seed_final_gained_15_points"]
    assert arm["gains_by_seed"] == pytest.approx([0.2, 0.2]) and arm["every_seed_gained_15_points"]
    md = report_markdown(report)
    assert "| GRPO | final policy | +0.450 | **+0.100** | +0.275 [" in md and md.rstrip().count("| no |") == 1
    assert "| GRPO | last quarter | +0.200 | +0.200 |" in md
    assert "| grpo-s1 | 0.500 | 0.500 | 0.400 | 0 | 1.0 |" in md
    # the figure's per-seed panel: a seed under +0.15 is hollow (its face fully transparent)
    from arpo_lib.viz.plots import plot_comparison

    one_arm = plot_comparison(report)
    assert len(one_arm.axes) == 4  # one arm: no paired-difference panel (an empty one read "no data")
    panel = one_arm.axes[2]
    final_points = [c for c in panel.collections if len(c.get_offsets()) == 2][1]  # dots, then triangles
    assert [float(y) for _, y in final_points.get_offsets()] == pytest.approx([0.45, 0.10])
    assert [float(f[3]) for f in final_points.get_facecolors()] == [1.0, 0.0]
    # an arm that has finished fewer seeds (a partial report): its cells stay under their seeds
    lagging = comparison_report(load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]"]), warm,
                                [*runs, dict(runs[1], algo="arpo")], ["a", "b"], warm_train=warm)
    assert "| ARPO | final policy | – | **+0.100** | +0.100 [" in report_markdown(lagging)
    # arms compared seed by seed on the final policy too: seed 0 equal, seed 1 +0.35
    two = comparison_report(load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]"]), warm,
                            [*runs, *(dict(r, algo="arpo", final_train_t=final(0.6, 0.9)) for r in runs)],
                            ["a", "b"], warm_train=warm)
    assert two["paired"]["arpo-grpo"]["final_t"]["differences"] == pytest.approx([0.0, 0.35])
    assert "| ARPO − GRPO | final policy at T=train | +0.175 [+0.000, +0.350] | 1 / 0 / 1 | 1.000 |" in report_markdown(two)
    paired_panel = plot_comparison(two).axes[4]  # final eval (dots) and final policy (triangles) per seed
    assert [[float(x) for x, _ in c.get_offsets()] for c in paired_panel.collections
            if len(c.get_offsets()) == 2][1] == pytest.approx([0.0, 0.35])
    assert "p = " in paired_panel.get_yticklabels()[0].get_text() and " / " in paired_panel.get_yticklabels()[0].get_text()
    # a run recorded without the measure: no final-policy row, no column
    plain = comparison_report(cfg, warm, [dict(r, final_train_t=None) for r in runs], ["a", "b"], warm_train=warm)
    assert "final_gain_over_warm_start" not in plain["arms"]["grpo"] and "final policy" not in report_markdown(plain)
    plain_two = comparison_report(load_config("configs/learning_miniwob_short.yaml", ["compare.seeds=[0, 1]"]), warm,
                                  [dict(r, final_train_t=None, algo=algo) for r in runs for algo in ("grpo", "arpo")],
                                  ["a", "b"], warm_train=warm)
    assert set(plain_two["paired"]["arpo-grpo"]) == {"eval", "train"}


def test_a_run_made_with_another_setting_is_refused_not_reused(tmp_path):
    """Runs are cached by directory: rerunning an experiment under the same name after changing
    e.g. train.steps must not report (or resume) the old runs as the new setting's."""
    from arpo_lib.experiments import require_same_setting, run_config, setting_changes
    from arpo_lib.run.config import save_config

    def cfg(*extra):
        return load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}", "name=exp", *extra])

    tasks, model = ["miniwob/click-test"], tmp_path / "exp" / "warm_start" / "model"
    first = run_config(cfg(), "arpo", 0, model, tasks)
    require_same_setting(first)  # nothing there yet
    first.run_dir.mkdir(parents=True)
    save_config(first, first.run_dir / "config.yaml")
    # the experiment's seed list, its arms and the later measure do not change a run: accepted
    require_same_setting(run_config(cfg("compare.seeds=[0, 1, 2, 3]", "compare.final_at_train_temperature=true"),
                                    "arpo", 0, model, tasks))
    changed = run_config(cfg("train.steps=7", "algo.kl_coef=0.1"), "arpo", 0, model, tasks)
    assert setting_changes(first.run_dir / "config.yaml", changed) == {
        "algo.kl_coef": (0.0, 0.1), "train.steps": (first.train.steps, 7)}
    with pytest.raises(RuntimeError, match=r"another setting \(algo.kl_coef: 0.0 -> 0.1, train.steps: .* -> 7\)"):
        require_same_setting(changed)
    # a key the saved config predates counts with its default (older runs stay usable)
    text = (first.run_dir / "config.yaml").read_text().replace("  norm_adv_by_std: true\n", "")
    (first.run_dir / "config.yaml").write_text(text)
    assert "norm_adv_by_std" not in text
    require_same_setting(first)
    with pytest.raises(RuntimeError, match="algo.norm_adv_by_std: True -> False"):
        require_same_setting(run_config(cfg("algo.norm_adv_by_std=false"), "arpo", 0, model, tasks))


def test_a_warm_start_made_with_another_setting_is_refused(tmp_path):
    from arpo_lib.experiments import _derive, warm_start_stage
    from arpo_lib.run.config import save_config

    def cfg(*extra):
        return load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}", "name=exp", *extra])

    ws = _derive(cfg(), "warm_start", **{"train.steps": 0, "train.demo_replay": 0})
    ws.run_dir.mkdir(parents=True)
    save_config(ws, ws.run_dir / "config.yaml")
    (ws.run_dir / "done.json").write_text('{"steps": 300}')
    # the RL settings do not touch the warm start: the finished one is used as it is
    assert warm_start_stage(cfg("algo.kl_coef=0.1", "train.steps=99")) == ws.run_dir / "model"
    with pytest.raises(RuntimeError, match=r"warm_start holds a run made with another setting \(warm_start.steps"):
        warm_start_stage(cfg("warm_start.steps=7"))


def test_a_warm_start_model_is_made_once_and_again_when_its_recipe_changes(tmp_path, monkeypatch):
    """`build_warm_start_model` (the smoke's warm start, made at set-up): the warm-start stage once,
    its model copied out with its record and a completion marker, the build directory removed;
    a second call makes nothing; another recipe makes it again."""
    from arpo_lib import experiments

    calls = []

    def fake_stage(cfg):
        calls.append(cfg.warm_start.steps)
        model = cfg.run_dir / "warm_start" / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"steps": cfg.warm_start.steps}))
        (cfg.run_dir / "warm_start" / "done.json").write_text(json.dumps(
            {"steps": cfg.warm_start.steps, "loss_first": 7.0, "loss_last": 0.3, "seconds": 1.0}))
        return model

    monkeypatch.setattr(experiments, "warm_start_stage", fake_stage)
    recipe = load_config("configs/smoke_warm_start.yaml")
    out = tmp_path / "models" / "warm"
    assert experiments.build_warm_start_model(recipe, out) == out
    steps = recipe.warm_start.steps
    assert (out / ".complete").is_file() and json.loads((out / "config.json").read_text()) == {"steps": steps}
    record = json.loads((out / "warm_start.json").read_text())
    assert record["loss_last"] == 0.3 and record["recipe"]["warm_start.steps"] == steps
    assert record["recipe"]["model.path"] == "models/small-uitars-qwen2vl" and "train.steps" not in record["recipe"]
    assert not (tmp_path / "models" / "warm.build").exists()
    experiments.build_warm_start_model(load_config("configs/smoke_warm_start.yaml", ["logging.progress=true"]), out)
    assert calls == [steps]  # made once: logging is not part of the recipe
    experiments.build_warm_start_model(load_config("configs/smoke_warm_start.yaml", ["warm_start.steps=7"]), out)
    assert calls == [steps, 7] and json.loads((out / "config.json").read_text()) == {"steps": 7}
    (out / ".complete").unlink()  # an interrupted copy: made again
    experiments.build_warm_start_model(load_config("configs/smoke_warm_start.yaml", ["warm_start.steps=7"]), out)
    assert calls == [steps, 7, 7]


def _save_weights(model: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(model / "model.safetensors"))


def _fake_stages(run_dir: Path) -> Path:
    model = run_dir / "warm_start" / "model"
    model.mkdir(parents=True)
    _save_weights(model, {"a.weight": torch.tensor([[3.0, 4.0]]), "b.bias": torch.ones(3)})
    (model / "config.json").write_text("{}")  # not part of the digest: only the weights are
    selection = run_dir / "selection"
    selection.mkdir()
    (selection / "selection.json").write_text(json.dumps(
        {"kept": ["miniwob/click-test@0"], "tasks": [{"task": "miniwob/click-test@0", "successes": 2},
                                                     {"task": "miniwob/click-test@1", "successes": 0}]}))
    return model


def test_the_archive_keeps_runs_and_refuses_other_stages(tmp_path, caplog):
    """compare.archive: the stages' fingerprint is written once and then checked; finished runs are
    copied in and restored into a fresh run directory; a restored run cannot grow a measure."""
    from arpo_lib.experiments import (archive_run, check_archived_stages, restore_archived_runs, run_arm,
                                      stage_fingerprint)

    archive = tmp_path / "docs" / "study"
    cfg = load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}/a", "name=exp",
                                                               "compare.seeds=[0, 1]", "compare.algos=[arpo, grpo]",
                                                               f"compare.archive={archive}"])
    model = _fake_stages(cfg.run_dir)
    warm = {"success_rate": 0.25}
    fingerprint = stage_fingerprint(cfg, model, ["miniwob/click-test@0"], warm, {"success_rate": 0.1}, None)
    assert fingerprint["kept"] == ["miniwob/click-test@0"]
    assert fingerprint["selection_successes"] == {"miniwob/click-test@0": 2, "miniwob/click-test@1": 0}
    assert fingerprint["baselines"] == {"eval_warm_start": 0.25, "eval_warm_start_train": 0.1, "eval_transfer": None}
    assert fingerprint["numerics"].startswith("torch ")
    assert fingerprint["warm_start_weight_norms"] == {"a.weight": 5.0, "b.bias": pytest.approx(3 ** 0.5)}
    check_archived_stages(archive, fingerprint)  # the first time: written
    assert json.loads((archive / "stages.json").read_text()) == fingerprint
    check_archived_stages(archive, {**fingerprint, "numerics": "another host"})  # said, not compared
    (model / "config.json").write_text('{"changed": 1}')
    assert stage_fingerprint(cfg, model, ["miniwob/click-test@0"], warm, {"success_rate": 0.1}, None) == fingerprint
    # the same up to rounding (another digest, norms within 1e-4): pooled; counts that moved are said
    _save_weights(model, {"a.weight": torch.tensor([[3.0, 4.0]]) * (1 + 1e-6), "b.bias": torch.ones(3)})
    close = stage_fingerprint(cfg, model, ["miniwob/click-test@0"], warm, {"success_rate": 0.1}, None)
    assert close["warm_start_weights_sha256"] != fingerprint["warm_start_weights_sha256"]
    moved = {**close, "baselines": {**close["baselines"], "eval_warm_start": 0.3}}
    with caplog.at_level(logging.WARNING, logger="arpo_lib.experiments"):
        check_archived_stages(archive, moved)
    assert "baselines differ" in caplog.text and "pooled" in caplog.text
    _save_weights(model, {"a.weight": torch.tensor([[3.0, 4.5]]), "b.bias": torch.ones(3)})
    other = stage_fingerprint(cfg, model, ["miniwob/click-test@0"], warm, {"success_rate": 0.1}, None)
    with pytest.raises(RuntimeError, match=r"\(warm_start_weights\).*other weights") as err:
        check_archived_stages(archive, {**other, "numerics": "this host"})
    assert fingerprint["numerics"] in str(err.value) and "'this host'" in str(err.value)
    with pytest.raises(RuntimeError, match=r"\(kept\)"):
        check_archived_stages(archive, {**fingerprint, "kept": ["miniwob/click-test@1"]})

    # a finished run goes into the archive; a fresh run directory gets it back, and only it
    run = cfg.run_dir / "arpo-s0"
    run.mkdir()
    record = {"algo": "arpo", "seed": 0, "eval": {"success_rate": 0.5}}
    (run / "final.json").write_text(json.dumps(record))
    (run / "config.yaml").write_text("name: arpo-s0\n")
    (run / "metrics.jsonl").write_text("{}\n")
    archive_run(run, archive)
    assert sorted(p.name for p in (archive / "arpo-s0").iterdir()) == ["config.yaml", "final.json"]
    fresh = load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}/b", "name=exp",
                                                                 "compare.seeds=[0, 1]", "compare.algos=[arpo, grpo]"])
    assert restore_archived_runs(fresh, archive) == ["arpo-s0"]
    assert json.loads((fresh.run_dir / "arpo-s0" / "final.json").read_text()) == record
    assert (fresh.run_dir / "arpo-s0" / "config.yaml").read_text() == "name: arpo-s0\n"
    assert restore_archived_runs(fresh, archive) == []  # already there: nothing copied again
    (fresh.run_dir / "arpo-s0" / "config.yaml").unlink()  # (a made-up config would fail the setting check)
    more_measures = load_config("configs/learning_miniwob_short.yaml", [
        f"out_dir={tmp_path}/b", "name=exp", "compare.seeds=[0, 1]", "compare.algos=[arpo, grpo]",
        "compare.transfer_samples_per_task=2"])
    with pytest.raises(RuntimeError, match="arpo-s0 finished without the measure .final_at_train_temperature..*restored from compare.archive"):
        run_arm(more_measures, "arpo", 0, model, ["miniwob/click-test@0"])


def test_the_figure_draws_every_registered_arm_in_its_own_colour():
    """The staleness study's arms (arpo_served, arpo_async1) are not among the published four: the
    comparison figure once failed on them after 8 runs (matplotlib: no colour None). Each arm gets
    its own colour, the same in every panel, and the paired panel names the arms."""
    from matplotlib.colors import to_rgba

    from arpo_lib.viz.plots import plot_comparison
    from arpo_lib.viz.study_plots import ARM_COLORS, arm_color
    cfg = load_config("configs/learning_miniwob_short.yaml",
                      ["compare.seeds=[0, 1]", "compare.algos=[arpo_served,arpo_async1]"])
    warm = {"success_rate": 0.5, "pass_at_k": 1.0, "episodes": 20, "env_errors": 0, "format_error_rate": 0.0,
            "tasks": [{"task": "a", "success_rate": 0.1}, {"task": "b", "success_rate": 0.5}]}
    runs = [_run(algo, seed, 0.5 + 0.1 * seed, [0.5, 0.6, 0.7, 0.8], [0] * 4, [0] * 4)
            for algo in ("arpo_served", "arpo_async1") for seed in (0, 1)]
    report = comparison_report(cfg, warm, runs, ["a", "b"], warm_train=warm)
    colors = {a: arm_color(a) for a in ("arpo_served", "arpo_async1")}
    assert len({*colors.values(), *ARM_COLORS.values()}) == 6  # none shared with another arm
    fig = plot_comparison(report)
    eval_panel, paired_panel = fig.axes[3], fig.axes[4]
    bars = [to_rgba(p.get_facecolor(), 1) for p in eval_panel.patches]
    assert bars == [to_rgba(colors["arpo_served"]), to_rgba(colors["arpo_async1"])]
    assert "ARPO async, staleness 1 − ARPO served" in paired_panel.get_yticklabels()[0].get_text()
    # an arm a plug-in registers later gets a colour too
    assert arm_color("not_registered_yet").startswith("C")


def test_the_staleness_arms_differ_from_served_arpo_only_in_schedule_and_correction(tmp_path):
    """arpo_async1 and arpo_async1_plain are arpo_served with one batch ahead; they differ from each
    other only in how the stale tokens are weighed (the study's question: what does the correction
    do for the staleness's cost?)."""
    from arpo_lib.experiments import PAIRS, run_config
    from arpo_lib.run.config import config_changes
    cfg = load_config("configs/learning_miniwob_short.yaml", [f"out_dir={tmp_path}"])
    runs = {a: run_config(cfg, a, 0, tmp_path / "warm", ["miniwob/click-test-2@0"])
            for a in ("arpo_served", "arpo_async1", "arpo_async1_plain")}

    def diff(a, b):
        return {k for k in config_changes(runs[b], runs[a]) if not k.startswith(("name", "run_dir"))}

    assert diff("arpo_async1", "arpo_served") == {"rollout.mode", "rollout.max_staleness"}
    assert diff("arpo_async1_plain", "arpo_async1") == {"algo.stale_correction"}
    assert runs["arpo_async1_plain"].algo.stale_correction == "none"
    assert ("arpo_async1_plain", "arpo_served") in PAIRS and ("arpo_async1_plain", "arpo_async1") in PAIRS
