"""ARPO against GRPO from one warm start: the paper's comparison at small scale, on the CPU.

The protocol (one config, e.g. `configs/learning_miniwob.yaml`; the experiment directory is the
run directory `<out_dir>/<name>`):

1. **warm start**: supervised fine-tuning on scripted demonstrations (`warm_start.*`), like
   UI-TARS's SFT before RL -> `warm_start/model`, shared by every run.
2. **task selection**: the warm-started policy runs `select.k` times per candidate task; tasks
   with at least `select.min_successes` successes are kept (ARPO's rule) -> `selection/`.
3. **baseline evaluation** of the warm start on the kept tasks -> `eval_warm_start/`.
4. **the runs**: for every seed in `compare.seeds`, ARPO (`algo.replay.enabled=true`) and GRPO
   (false) from the same weights, tasks, rollout budget and seeds; each ends with the same
   evaluation (`eval.seed`, `eval.samples_per_task`) -> `<algo>-s<seed>/`.
5. **report**: `report.json`, `report.md` (means and spread over seeds) and `comparison.png`.

Every stage is skipped when its result exists, and a run resumes from its last checkpoint, so
rerunning the same command after a crash continues where it stopped. The replay buffer starts
empty in both arms (`train.demo_replay` is forced to 0): ARPO's buffer holds only the policy's
own successes, as in the paper.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from arpo_lib import build
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, config_from_dict
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import atomic_write_text, read_jsonl

log = logging.getLogger(__name__)

ALGOS = {"arpo": True, "grpo": False}
"""Arm name -> algo.replay.enabled."""


def _derive(cfg: RunConfig, name: str, **changes: Any) -> RunConfig:
    """A copy of the experiment's config for one stage: dotted keys -> values."""
    data = cfg.to_dict()
    data["out_dir"], data["name"] = str(cfg.run_dir), name
    for key, value in changes.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return config_from_dict(data)


def _done(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def warm_start_stage(cfg: RunConfig) -> Path:
    """SFT on scripted demonstrations once; returns the saved model directory."""
    model_dir = cfg.run_dir / "warm_start" / "model"
    if _done(cfg.run_dir / "warm_start" / "done.json"):
        return model_dir
    ws_cfg = _derive(cfg, "warm_start", **{"train.steps": 0, "train.demo_replay": 0})
    with build.trainer(ws_cfg, resume=RunDir(ws_cfg.run_dir).config.exists()) as trainer:
        t0 = time.monotonic()
        losses = trainer.warm_start()
        trainer.policy.save(model_dir)
    atomic_write_text(cfg.run_dir / "warm_start" / "done.json", json.dumps(
        {"steps": len(losses), "loss_first": losses[0] if losses else None,
         "loss_last": losses[-1] if losses else None, "seconds": round(time.monotonic() - t0, 1)}))
    return model_dir


def selection_stage(cfg: RunConfig, model_dir: Path) -> list[str]:
    """ARPO's task selection with the warm-started policy; returns the kept tasks."""
    from arpo_lib.evaluation.task_selection import load_selection
    from arpo_lib.workflows import run_task_selection

    out = RunDir(cfg.run_dir).selection
    if not (out / layout.SELECTION_RESULT).is_file():
        sel_cfg = _derive(cfg, "selection", **{"model.path": str(model_dir)})
        run_task_selection(sel_cfg, out)
    kept = load_selection(out)
    if not kept:
        raise RuntimeError(f"task selection kept no task ({out / 'selection.md'}): the warm start is too weak "
                           "for RL to have any signal; train it longer (warm_start.steps) or raise select.k")
    return kept


def evaluate_model(cfg: RunConfig, model_dir: Path, tasks: list[str], out: Path) -> dict[str, Any]:
    """The fixed evaluation protocol (eval.*) of a saved model on `tasks`; cached in out/results.json."""
    from arpo_lib.evaluation.evaluate import evaluate_run

    done = _done(out / layout.EVAL_RESULTS)
    if done:
        return done
    ev_cfg = _derive(cfg, out.name, **{"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None})
    with build.engine(ev_cfg) as engine:
        result = evaluate_run(engine, ev_cfg, out, description=f"eval {out.name}")
    return result.to_dict()


def run_arm(cfg: RunConfig, algo: str, seed: int, model_dir: Path, tasks: list[str]) -> dict[str, Any]:
    """One RL run from the warm start, then its final evaluation; resumable, cached in final.json."""
    name = f"{algo}-s{seed}"
    final = cfg.run_dir / name / "final.json"
    if _done(final):
        return _done(final)  # type: ignore[return-value]
    run_cfg = _derive(cfg, name, **{"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None,
                                    "algo.replay.enabled": ALGOS[algo], "train.seed": seed,
                                    "warm_start.steps": 0, "warm_start.demos_per_task": 0,
                                    "train.demo_replay": 0,
                                    "train.tasks_per_batch": min(cfg.train.tasks_per_batch, len(tasks))})
    resume = RunDir(run_cfg.run_dir).metrics.exists()
    t0 = time.monotonic()
    with build.trainer(run_cfg, resume=resume) as trainer:
        log.info("[compare] %s: %s (%d steps on %d tasks)", name,
                 f"resuming at step {trainer.step}" if resume else "starting", run_cfg.train.steps, len(tasks))
        trainer.train()
        trainer.policy.save(run_cfg.run_dir / "final_model")
    evaluation = evaluate_model(cfg, run_cfg.run_dir / "final_model", tasks, run_cfg.run_dir / "eval_final")
    record = {"algo": algo, "seed": seed, "eval": _eval_summary(evaluation),
              "seconds": round(time.monotonic() - t0, 1), **_train_summary(run_cfg.run_dir)}
    atomic_write_text(final, json.dumps(record, indent=1))
    return record


def _eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in ("success_rate", "pass_at_k", "episodes", "env_errors", "format_error_rate")}


def _train_summary(run_dir: Path) -> dict[str, Any]:
    lines = [m for m in read_jsonl(RunDir(run_dir).metrics) if "success_rate" in m]
    return {
        "train_success": [m["success_rate"] for m in lines],
        "all_failed_groups": [m["all_failed_groups"] for m in lines],
        "replay_injections": [m["replay_injections"] for m in lines],
    }


def run_comparison(cfg: RunConfig) -> dict[str, Any]:
    """All stages; returns the report (also written to report.json / report.md / comparison.png)."""
    from arpo_lib.viz.plots import plot_comparison, save_figure

    t0 = time.monotonic()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = warm_start_stage(cfg)
    tasks = selection_stage(cfg, model_dir)
    warm = evaluate_model(cfg, model_dir, tasks, cfg.run_dir / "eval_warm_start")
    runs = [run_arm(cfg, algo, seed, model_dir, tasks) for seed in cfg.compare.seeds for algo in cfg.compare.algos]
    report = comparison_report(cfg, warm, runs, tasks)
    report["seconds_total_this_call"] = round(time.monotonic() - t0, 1)
    atomic_write_text(cfg.run_dir / "report.json", json.dumps(report, indent=1))
    atomic_write_text(cfg.run_dir / "report.md", report_markdown(report))
    save_figure(plot_comparison(report), cfg.run_dir / "comparison.png")
    return report


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def comparison_report(cfg: RunConfig, warm: dict[str, Any], runs: list[dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    """Per arm: final evaluation success (mean, std, range over seeds), its change over the warm
    start, train-rollout success over the last quarter of steps, share of all-failed groups, and
    replay injections."""
    arms: dict[str, Any] = {}
    for algo in cfg.compare.algos:
        rs = [r for r in runs if r["algo"] == algo]
        if not rs:
            continue
        tail = max(1, len(rs[0]["train_success"]) // 4)
        arms[algo] = {
            "seeds": [r["seed"] for r in rs],
            "eval_success": _stats([r["eval"]["success_rate"] for r in rs]),
            "eval_gain_over_warm_start": _stats([r["eval"]["success_rate"] - warm["success_rate"] for r in rs]),
            "train_success_last_quarter": _stats([statistics.fmean(r["train_success"][-tail:]) for r in rs]),
            "train_success_first_quarter": _stats([statistics.fmean(r["train_success"][:tail]) for r in rs]),
            "all_failed_share": _stats([statistics.fmean(r["all_failed_groups"]) for r in rs]),
            "replay_injections": _stats([float(sum(r["replay_injections"])) for r in rs]),
        }
    return {"experiment": str(cfg.run_dir), "tasks": tasks, "steps": cfg.train.steps,
            "rollouts_per_step": cfg.train.tasks_per_batch * cfg.rollout.group_size,
            "eval": {"samples_per_task": cfg.eval.samples_per_task, "temperature": cfg.eval.temperature,
                     "seed": cfg.eval.seed},
            "warm_start_eval": _eval_summary(warm), "arms": arms, "runs": runs}


def report_markdown(report: dict[str, Any]) -> str:
    w = report["warm_start_eval"]["success_rate"]
    lines = [f"# ARPO vs GRPO from one warm start ({len(report['tasks'])} tasks, {report['steps']} steps x "
             f"{report['rollouts_per_step']} rollouts)", "",
             f"Warm start (SFT) evaluation success: **{w:.3f}** "
             f"({report['warm_start_eval']['episodes']} episodes; eval k={report['eval']['samples_per_task']}, "
             f"temperature {report['eval']['temperature']}, seed {report['eval']['seed']}).", "",
             "| arm | seeds | final eval success (mean ± std) | range | gain over warm start | train success, first → last quarter | all-failed groups | replay injections |",
             "|---|---|---|---|---|---|---|---|"]
    for algo, a in report["arms"].items():
        e, g = a["eval_success"], a["eval_gain_over_warm_start"]
        lines.append(f"| {algo.upper()} | {', '.join(map(str, a['seeds']))} | {e['mean']:.3f} ± {e['std']:.3f} | "
                     f"{e['min']:.3f}–{e['max']:.3f} | {g['mean']:+.3f} | "
                     f"{a['train_success_first_quarter']['mean']:.3f} → {a['train_success_last_quarter']['mean']:.3f} | "
                     f"{a['all_failed_share']['mean']:.2f} | {a['replay_injections']['mean']:.1f} |")
    lines += ["", "| run | final eval success | train success (last quarter) | injections | seconds |", "|---|---|---|---|---|"]
    for r in report["runs"]:
        tail = max(1, len(r["train_success"]) // 4)
        lines.append(f"| {r['algo']}-s{r['seed']} | {r['eval']['success_rate']:.3f} | "
                     f"{statistics.fmean(r['train_success'][-tail:]):.3f} | {sum(r['replay_injections'])} | {r['seconds']} |")
    lines += ["", f"Tasks: {', '.join(report['tasks'])}"]
    return "\n".join(lines) + "\n"


def report_digest(report: dict[str, Any]) -> str:
    """The seed-determined numbers of a comparison, rounded (what nbval compares)."""
    rows = [f"warm start eval {report['warm_start_eval']['success_rate']:.3f}, tasks kept {len(report['tasks'])}"]
    for r in report["runs"]:
        rows.append(f"{r['algo']}-s{r['seed']}: eval {r['eval']['success_rate']:.3f}, "
                    f"injections {sum(r['replay_injections'])}")
    return "\n".join(rows)
