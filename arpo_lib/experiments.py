"""GRPO, ARPO and ARPO with off-policy correction from one warm start: the paper's comparison at
small scale, on the CPU, with enough seeds to say whether a difference is real.

The protocol (one config, e.g. `configs/learning_miniwob.yaml`; the experiment directory is the
run directory `<out_dir>/<name>`):

1. **warm start**: supervised fine-tuning on scripted demonstrations (`warm_start.*`), like
   UI-TARS's SFT before RL -> `warm_start/model`, shared by every run.
2. **task selection**: the warm-started policy runs `select.k` times per candidate task; tasks
   with at least `select.min_successes` successes are kept (ARPO's rule) -> `selection/`.
3. **baselines** of the warm start on the kept tasks: the fixed evaluation (`eval.*`) ->
   `eval_warm_start/`, and `compare.baseline_samples_per_task` episodes per task at the training
   temperature -> `eval_warm_start_train/` (what training-rollout success is compared with, task
   by task: batches draw a few tasks per step, so only per-task rates compare).
4. **the runs**: for every seed in `compare.seeds`, every arm of `compare.algos` (`COMPARISON_ARMS`) from the
   same weights, tasks, rollout budget and seeds; each ends with the same evaluation -> `<arm>-s<seed>/`.
5. **report**: per arm the mean with a bootstrap 95% interval over seeds; paired differences per
   seed with an exact paired permutation test (and a sign test); `report.json`, `report.md`,
   `comparison.png` (`evaluation.stats` holds the statistics).

Every stage is skipped when its result exists, and a run resumes from its last checkpoint, so
rerunning the same command (in this session or a later one) continues where it stopped. The
replay buffer starts empty in every arm (`train.demo_replay` is forced to 0): ARPO's buffer
holds only the policy's own successes, as in the paper.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from arpo_lib import build
from arpo_lib.evaluation.stats import band, bootstrap_ci, paired_permutation_test, sign_test
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, config_changes, config_from_dict, read_saved_config
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import atomic_write_text, read_jsonl
from arpo_lib.run.registry import COMPARISON_ARMS

log = logging.getLogger(__name__)

ARM_LABELS = {"grpo": "GRPO", "arpo": "ARPO", "arpo_tis": "ARPO+TIS"}
PAIRS = (("arpo", "grpo"), ("arpo_tis", "arpo"), ("arpo_tis", "grpo"))
"""Paired comparisons the report makes (first minus second), where both arms ran."""


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
    ws_cfg = _derive(cfg, "warm_start", **{"train.steps": 0, "train.demo_replay": 0})
    require_same_setting(ws_cfg, free=WARM_START_FREE, only=WARM_START_SETTING)
    if _done(cfg.run_dir / "warm_start" / "done.json"):
        return model_dir
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


def evaluate_model(cfg: RunConfig, model_dir: Path, tasks: list[str], out: Path,
                   temperature: float | None = None, samples_per_task: int | None = None) -> dict[str, Any]:
    """The fixed evaluation protocol (eval.*, at `temperature` and with `samples_per_task` when
    given) of a saved model on `tasks`; cached in out/results.json."""
    from arpo_lib.evaluation.evaluate import evaluate_run

    done = _done(out / layout.EVAL_RESULTS)
    if done:
        return done
    changes: dict[str, Any] = {"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None}
    if temperature is not None:  # a measure at another temperature: the run's own protocol
        changes.update({"eval.temperature": temperature, "eval.protocol": "run"})
    if samples_per_task is not None:
        changes["eval.samples_per_task"] = samples_per_task
    ev_cfg = _derive(cfg, out.name, **changes)
    with build.engine(ev_cfg, protocol=ev_cfg.eval.protocol) as engine:
        result = evaluate_run(engine, ev_cfg, out, description=f"eval {out.name}")
    return result.to_dict()


def run_config(cfg: RunConfig, algo: str, seed: int, model_dir: Path, tasks: list[str]) -> RunConfig:
    """The config of one run of the experiment: arm `algo`, training seed `seed`, from the warm
    start in `model_dir` on the kept `tasks` (its directory: `<experiment>/<algo>-s<seed>`)."""
    return _derive(cfg, f"{algo}-s{seed}", **{"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None,
                                              **COMPARISON_ARMS[algo], "train.seed": seed,
                                              "warm_start.steps": 0, "warm_start.demos_per_task": 0,
                                              "train.demo_replay": 0,
                                              "train.tasks_per_batch": min(cfg.train.tasks_per_batch, len(tasks))})


SETTING_FREE = ("out_dir", "name", "model.path", "compare.", "logging.")
"""Config keys (or prefixes) that do not change what a run of the experiment computes: where it
lives, the experiment's seed list and arms, logging. Every other key is part of a run's setting."""


WARM_START_SETTING = ("warm_start.", "env.", "model.", "agent.", "train.seed")
"""What the warm start depends on (its demonstrations, model and prompt), for the same check.
env.tasks and env.instances_per_task are not compared there: the trainer saves them expanded
into fixed instances, so the saved form is not the experiment's."""
WARM_START_FREE = ("out_dir", "name", "env.tasks", "env.instances_per_task")


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def setting_changes(saved: Path, cfg: RunConfig, free: tuple[str, ...] = SETTING_FREE,
                    only: tuple[str, ...] | None = None) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (value in the config saved at `saved`, value in `cfg`) for every key of a
    run's setting that differs (keys of `free` left out; with `only`, only those keys; a key the
    saved config predates counts with its default)."""
    return {k: v for k, v in config_changes(read_saved_config(saved), cfg).items()
            if not _matches(k, free) and (only is None or _matches(k, only))}


def require_same_setting(run_cfg: RunConfig, free: tuple[str, ...] = SETTING_FREE,
                         only: tuple[str, ...] | None = None) -> None:
    """RuntimeError when the run directory already holds a run (started or finished) made with
    another setting: the experiment caches runs by directory, so changing e.g. train.steps and
    rerunning under the same name would otherwise report the old runs as the new setting's, or
    resume them with the new one."""
    saved = RunDir(run_cfg.run_dir).config
    if not saved.is_file():
        return
    changes = setting_changes(saved, run_cfg, free, only)
    if changes:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:8])
        raise RuntimeError(f"{run_cfg.run_dir} holds a run made with another setting ({shown}"
                           f"{', ...' if len(changes) > 8 else ''}): give the experiment another name "
                           f"(name=...) or move that run away")


def run_arm(cfg: RunConfig, algo: str, seed: int, model_dir: Path, tasks: list[str]) -> dict[str, Any]:
    """One RL run from the warm start, then its final evaluation; resumable, cached in final.json."""
    run_cfg = run_config(cfg, algo, seed, model_dir, tasks)
    final = run_cfg.run_dir / "final.json"
    require_same_setting(run_cfg)
    if _done(final):
        return _with_final_at_train_temperature(cfg, _done(final), final, tasks)  # type: ignore[arg-type]
    name = run_cfg.name
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
    return _with_final_at_train_temperature(cfg, record, final, tasks)


def _with_final_at_train_temperature(cfg: RunConfig, record: dict[str, Any], final: Path,
                                     tasks: list[str]) -> dict[str, Any]:
    """`record` with `final_train_t` (the final policy at the training temperature on the training
    tasks, `compare.baseline_samples_per_task` episodes each, the baseline's episode seeds) when
    compare.final_at_train_temperature is on; measured once (cached in eval_final_t/, recorded in
    final.json), also for runs that finished before the switch was turned on."""
    if not cfg.compare.final_at_train_temperature or "final_train_t" in record:
        return record
    result = evaluate_model(cfg, final.parent / "final_model", tasks, final.parent / "eval_final_t",
                            temperature=cfg.rollout.temperature,
                            samples_per_task=cfg.compare.baseline_samples_per_task)
    record = {**record, "final_train_t": {**_eval_summary(result),
                                          "by_task": {t["task"]: t["success_rate"] for t in result.get("tasks") or []}}}
    atomic_write_text(final, json.dumps(record, indent=1))
    return record


def _eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in ("success_rate", "pass_at_k", "episodes", "env_errors", "format_error_rate")}


def _train_summary(run_dir: Path) -> dict[str, Any]:
    lines = [m for m in read_jsonl(RunDir(run_dir).metrics) if "success_rate" in m]
    return {
        "train_success": [m["success_rate"] for m in lines],
        "train_success_by_task": [m.get("success_by_task") or {} for m in lines],
        "all_failed_groups": [m["all_failed_groups"] for m in lines],
        "replay_injections": [m["replay_injections"] for m in lines],
        "format_errors": [m["format_error_rate"] for m in lines],
        "is_weight_mean": [m["is_weight_mean"] for m in lines if "is_weight_mean" in m],
        "is_capped_share": [m["is_capped_share"] for m in lines if "is_capped_share" in m],
        "replay_age_mean": [m["replay_age_mean"] for m in lines if m.get("replay_injections")],
    }


def finished_runs(cfg: RunConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """(records of the runs of `compare.seeds` x `compare.algos` that have finished, names of
    those that have not), in the order the experiment runs them. Reads only final.json files."""
    done, missing = [], []
    for seed in cfg.compare.seeds:
        for algo in cfg.compare.algos:
            record = _done(cfg.run_dir / f"{algo}-s{seed}" / "final.json")
            if record:
                done.append(record)
            else:
                missing.append(f"{algo}-s{seed}")
    return done, missing


def _require_finished_stages(cfg: RunConfig) -> None:
    """RuntimeError naming what is missing unless the warm start, the selection, both baseline
    evaluations and at least one run have finished (what `--report-only` reads, running nothing)."""
    stages = [cfg.run_dir / "warm_start" / "done.json", RunDir(cfg.run_dir).selection / layout.SELECTION_RESULT,
              cfg.run_dir / "eval_warm_start" / layout.EVAL_RESULTS,
              cfg.run_dir / "eval_warm_start_train" / layout.EVAL_RESULTS]
    absent = [str(p) for p in stages if not p.is_file()]
    if absent:
        raise RuntimeError(f"nothing to report in {cfg.run_dir} yet: stages not finished: {', '.join(absent)}")
    if not finished_runs(cfg)[0]:
        raise RuntimeError(f"nothing to report in {cfg.run_dir} yet: no run has finished")


def run_comparison(cfg: RunConfig, *, report_only: bool = False) -> dict[str, Any]:
    """All stages; returns the report (also written to report.json / report.md / comparison.png).

    `report_only`: run nothing; report the runs that have finished so far (a long experiment can
    be looked at while it runs, or after it was stopped). The report then names the missing runs
    (`missing_runs`). RuntimeError if the warm start, selection or baseline evaluations, or every
    run, are not finished yet."""
    from arpo_lib.viz.plots import plot_comparison, save_figure

    t0 = time.monotonic()
    if report_only:
        _require_finished_stages(cfg)
        model_dir = cfg.run_dir / "warm_start" / "model"
    else:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        model_dir = warm_start_stage(cfg)
    tasks = selection_stage(cfg, model_dir)
    warm = evaluate_model(cfg, model_dir, tasks, cfg.run_dir / "eval_warm_start")
    warm_train = evaluate_model(cfg, model_dir, tasks, cfg.run_dir / "eval_warm_start_train",
                                temperature=cfg.rollout.temperature,
                                samples_per_task=cfg.compare.baseline_samples_per_task)
    if report_only:
        runs, missing = finished_runs(cfg)
    else:
        runs = [run_arm(cfg, algo, seed, model_dir, tasks) for seed in cfg.compare.seeds for algo in cfg.compare.algos]
        missing = []
    report = comparison_report(cfg, warm, runs, tasks, warm_train=warm_train)
    report["missing_runs"] = missing
    report["seconds_total_this_call"] = round(time.monotonic() - t0, 1)
    atomic_write_text(cfg.run_dir / "report.json", json.dumps(report, indent=1))
    atomic_write_text(cfg.run_dir / "report.md", report_markdown(report))
    save_figure(plot_comparison(report), cfg.run_dir / "comparison.png")
    return report


def _stats(values: list[float], seed: int = 0) -> dict[str, float]:
    """Mean, Bessel std, range and the bootstrap 95% interval of the mean over seeds."""
    ci = bootstrap_ci(values, seed=seed)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values), "lo": ci["lo"], "hi": ci["hi"]}


def moving(values: list[float], window: int = 3) -> list[float]:
    """Trailing moving average (the curves' smoothing)."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def _quarter(curve: list[float], last: bool) -> float:
    tail = max(1, len(curve) // 4)
    return statistics.fmean(curve[-tail:] if last else curve[:tail])


def quarter_by_task(run: dict[str, Any], last: bool) -> dict[str, float]:
    """Training-rollout success per task over the first or last quarter of a run's steps
    (successes / episodes of that task in those steps); {} for a run recorded without it."""
    per_step = run.get("train_success_by_task") or []
    if not per_step or not any(per_step):
        return {}
    tail = max(1, len(per_step) // 4)
    counts: dict[str, list[int]] = {}
    for step in (per_step[-tail:] if last else per_step[:tail]):
        for task, (successes, episodes) in step.items():
            c = counts.setdefault(task, [0, 0])
            c[0] += successes
            c[1] += episodes
    return {task: s / n for task, (s, n) in sorted(counts.items()) if n}


def train_quarter(run: dict[str, Any], last: bool) -> float:
    """Training success over a quarter, every task weighted equally (the batches draw a few tasks
    per step, so a quarter's raw rate weighs them by chance); the raw rate for old records."""
    by_task = quarter_by_task(run, last)
    return statistics.fmean(by_task.values()) if by_task else _quarter(run["train_success"], last)


def train_gain(run: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Last-quarter training success minus the warm start's at the training temperature, task by
    task, averaged over the tasks the last quarter trained on: a gain that no task mix can fake.
    `baseline`: an evaluation result (its per-task `tasks`); the overall rates when either side
    has no per-task numbers."""
    by_task = quarter_by_task(run, last=True)
    warm = {t["task"]: t["success_rate"] for t in baseline.get("tasks") or []}
    if by_task and all(task in warm for task in by_task):
        return statistics.fmean(rate - warm[task] for task, rate in by_task.items())
    return _quarter(run["train_success"], True) - baseline["success_rate"]


def final_gain(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """The final policy's success at the training temperature minus the warm start's, task by
    task (same episodes), averaged over tasks; None for a run measured without it."""
    final = run.get("final_train_t")
    if not final:
        return None
    warm = {t["task"]: t["success_rate"] for t in baseline.get("tasks") or []}
    by_task = final.get("by_task") or {}
    if by_task and all(task in warm for task in by_task):
        return statistics.fmean(rate - warm[task] for task, rate in by_task.items())
    return final["success_rate"] - baseline["success_rate"]


def comparison_report(cfg: RunConfig, warm: dict[str, Any], runs: list[dict[str, Any]], tasks: list[str],
                      warm_train: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per arm (mean, std, range and bootstrap 95% interval over seeds): final evaluation success
    and its gain over the warm start; training-rollout success in the first and last quarter of
    steps and the last quarter's gain over the warm start at the training temperature; share of
    all-failed groups; replay injections; importance weights and replay age where they apply.
    Paired (same seed) differences between arms with permutation and sign-test p-values."""
    warm_t = warm_train or warm
    arms: dict[str, Any] = {}
    for algo in cfg.compare.algos:
        rs = sorted((r for r in runs if r["algo"] == algo), key=lambda r: r["seed"])
        if not rs:
            continue
        gains = [train_gain(r, warm_t) for r in rs]
        arm = {
            "seeds": [r["seed"] for r in rs],
            "eval_success": _stats([r["eval"]["success_rate"] for r in rs]),
            "eval_gain_over_warm_start": _stats([r["eval"]["success_rate"] - warm["success_rate"] for r in rs]),
            "train_success_last_quarter": _stats([train_quarter(r, True) for r in rs]),
            "train_success_first_quarter": _stats([train_quarter(r, False) for r in rs]),
            "train_gain_over_warm_start": _stats(gains),
            "every_seed_gained_15_points": all(g >= 0.15 for g in gains),
            "gains_by_seed": gains,
            "all_failed_share": _stats([statistics.fmean(r["all_failed_groups"]) for r in rs]),
            "replay_injections": _stats([float(sum(r["replay_injections"])) for r in rs]),
            "seconds": _stats([float(r["seconds"]) for r in rs]),
        }
        finals = [final_gain(r, warm_t) for r in rs]
        if finals and all(f is not None for f in finals):
            arm["final_gain_over_warm_start"] = _stats(finals)  # type: ignore[arg-type]
            arm["final_gains_by_seed"] = finals
            arm["every_seed_final_gained_15_points"] = all(f >= 0.15 for f in finals)  # type: ignore[operator]
        by_task = [quarter_by_task(r, True) for r in rs]
        arm["train_last_quarter_by_task"] = {
            task: statistics.fmean(b[task] for b in by_task if task in b)
            for task in sorted({t for b in by_task for t in b})}
        arm["curves"] = {key: band([moving(r[key]) for r in rs]) for key in ("train_success", "all_failed_groups")}
        for key in ("is_weight_mean", "is_capped_share", "replay_age_mean"):
            per_run = [statistics.fmean(r[key]) for r in rs if r.get(key)]
            if per_run:
                arm[key] = _stats(per_run)
        arms[algo] = arm
    pairs = {}
    for a, b in PAIRS:
        if a not in arms or b not in arms:
            continue
        seeds = sorted(set(arms[a]["seeds"]) & set(arms[b]["seeds"]))
        measures = ["eval", "train"]
        if all(r.get("final_train_t") for r in runs if r["algo"] in (a, b) and r["seed"] in seeds):
            measures.append("final_t")
        pairs[f"{a}-{b}"] = {m: _paired(runs, a, b, seeds, m) for m in measures}
    return {"experiment": str(cfg.run_dir), "tasks": tasks, "steps": cfg.train.steps,
            "rollouts_per_step": cfg.train.tasks_per_batch * cfg.rollout.group_size,
            "eval": {"samples_per_task": cfg.eval.samples_per_task, "temperature": cfg.eval.temperature,
                     "seed": cfg.eval.seed, "train_temperature": cfg.rollout.temperature,
                     "protocol": cfg.eval.protocol},
            "warm_start_eval": _eval_summary(warm),
            "warm_start_train_temperature": _eval_summary(warm_train) if warm_train else None,
            "warm_start_train_by_task": {t["task"]: t["success_rate"] for t in (warm_train or warm).get("tasks") or []},
            "arms": arms, "paired": pairs, "runs": runs}


PAIRED_MEASURES = {"eval": "final eval success", "train": "train success, last quarter",
                   "final_t": "final policy at T=train"}
"""The measures arms are compared on, seed by seed (`final_t` where every run of both has it)."""


def _paired(runs: list[dict[str, Any]], a: str, b: str, seeds: list[int], measure: str) -> dict[str, Any]:
    """Per-seed differences a - b of final evaluation success (`eval`), last-quarter training
    success (`train`) or the final policy's success on the training tasks at the training
    temperature (`final_t`), their mean with a bootstrap interval, and two-sided p-values."""
    def value(algo: str, seed: int) -> float:
        r = next(r for r in runs if r["algo"] == algo and r["seed"] == seed)
        if measure == "eval":
            return r["eval"]["success_rate"]
        return r["final_train_t"]["success_rate"] if measure == "final_t" else train_quarter(r, True)

    xa, xb = [value(a, s) for s in seeds], [value(b, s) for s in seeds]
    diffs = [x - y for x, y in zip(xa, xb)]
    return {"seeds": seeds, "differences": diffs, **_stats(diffs),
            "p_permutation": paired_permutation_test(xa, xb), "p_sign": sign_test(xa, xb)}


def report_markdown(report: dict[str, Any]) -> str:
    w = report["warm_start_eval"]["success_rate"]
    wt = (report.get("warm_start_train_temperature") or report["warm_start_eval"])["success_rate"]
    temps = report["eval"]
    lines = [f"# {' vs '.join(ARM_LABELS.get(a, a) for a in report['arms'])} from one warm start "
             f"({len(report['tasks'])} tasks, {report['steps']} steps x {report['rollouts_per_step']} rollouts)", "",
             f"Evaluation protocol `{temps.get('protocol', 'run')}`. "
             f"Warm start (SFT): evaluation success **{w:.3f}** at temperature {temps['temperature']} "
             f"({report['warm_start_eval']['episodes']} episodes, seed {temps['seed']}); "
             f"**{wt:.3f}** at the training temperature {temps.get('train_temperature', 1.0)}.", "",
             "Means over seeds with bootstrap 95% intervals.", "",
             "| arm | seeds | final eval success | gain over warm start | train success, first → last quarter | "
             "last-quarter gain over warm start (T=train) | every seed +15 pts | all-failed groups | injections |",
             "|---|---|---|---|---|---|---|---|---|"]
    for algo, a in report["arms"].items():
        e, g, f, last = a["eval_success"], a["eval_gain_over_warm_start"], a["train_success_first_quarter"], \
            a["train_success_last_quarter"]
        tg = a.get("train_gain_over_warm_start", {"mean": last["mean"] - wt, "lo": 0.0, "hi": 0.0})
        lines.append(f"| {ARM_LABELS.get(algo, algo)} | {len(a['seeds'])} | {e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] | "
                     f"{g['mean']:+.3f} | {f['mean']:.3f} → {last['mean']:.3f} | "
                     f"{tg['mean']:+.3f} [{tg['lo']:+.3f}, {tg['hi']:+.3f}] | "
                     f"{'yes' if a.get('every_seed_gained_15_points') else 'no'} | {a['all_failed_share']['mean']:.2f} | "
                     f"{a['replay_injections']['mean']:.1f} |")
    arms_all = report["arms"]
    if any(a.get("gains_by_seed") for a in arms_all.values()):
        with_final = any(a.get("final_gains_by_seed") for a in arms_all.values())
        lines += ["", "Training gain over the warm start per seed, task by task at the training temperature: "
                  "last quarter of the training rollouts" + (
                      "; and the final policy run on the training tasks with the baseline's episodes "
                      "(`compare.final_at_train_temperature`)" if with_final else "") + ".", ""]
        seeds = sorted({seed for a in arms_all.values() for seed in a["seeds"]})  # arms may lag (partial report)
        lines += ["| arm | measure | " + " | ".join(f"s{seed}" for seed in seeds) + " | mean [95% CI] | every seed +15 pts |",
                  "|---|---|" + "---|" * (len(seeds) + 2)]
        for algo, a in arms_all.items():
            rows = [("last quarter", a.get("gains_by_seed"), a.get("train_gain_over_warm_start"),
                     a.get("every_seed_gained_15_points")),
                    ("final policy", a.get("final_gains_by_seed"), a.get("final_gain_over_warm_start"),
                     a.get("every_seed_final_gained_15_points"))]
            for label, gains, st, every in rows:
                if not gains:
                    continue
                by_seed = dict(zip(a["seeds"], gains))
                cells = ["–" if seed not in by_seed else
                         (f"**{by_seed[seed]:+.3f}**" if by_seed[seed] < 0.15 else f"{by_seed[seed]:+.3f}") for seed in seeds]
                lines.append(f"| {ARM_LABELS.get(algo, algo)} | {label} | " + " | ".join(cells) +
                             f" | {st['mean']:+.3f} [{st['lo']:+.3f}, {st['hi']:+.3f}] | {'yes' if every else 'no'} |")
    if report.get("paired"):
        lines += ["", "Paired differences (same seed: same first batch, task order and evaluation episodes):", "",
                  "| comparison | measure | mean difference [95% CI] | seeds a > b / a < b / equal | p (permutation) | p (sign) |",
                  "|---|---|---|---|---|---|"]
        for name, measures in report["paired"].items():
            a, b = name.split("-")
            for measure, d in measures.items():
                diffs = d["differences"]
                wins, losses = sum(x > 0 for x in diffs), sum(x < 0 for x in diffs)
                lines.append(f"| {ARM_LABELS.get(a, a)} − {ARM_LABELS.get(b, b)} | {PAIRED_MEASURES[measure]} | "
                             f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | "
                             f"{wins} / {losses} / {len(diffs) - wins - losses} | "
                             f"{d['p_permutation']:.3f} | {d['p_sign']:.3f} |")
    by_task = report.get("warm_start_train_by_task") or {}
    if by_task and any(a.get("train_last_quarter_by_task") for a in report["arms"].values()):
        arms = list(report["arms"])
        lines += ["", "Training success per task at the training temperature: the warm start, and each arm's "
                  "last quarter (mean over seeds). The gains above are these differences averaged over tasks.", "",
                  "| task | warm start | " + " | ".join(ARM_LABELS.get(a, a) for a in arms) + " |",
                  "|---|---|" + "---|" * len(arms)]
        for task, rate in by_task.items():
            cells = [report["arms"][a].get("train_last_quarter_by_task", {}).get(task) for a in arms]
            lines.append(f"| {task} | {rate:.3f} | " + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    final_col = any(r.get("final_train_t") for r in report["runs"])
    lines += ["", "| run | final eval success | train success (last quarter) | "
              + ("final policy at T=train | " if final_col else "") + "injections | seconds |",
              "|---|---|---|" + ("---|" if final_col else "") + "---|---|"]
    for r in sorted(report["runs"], key=lambda r: (r["algo"], r["seed"])):
        final_cell = ""
        if final_col:
            final_cell = f"{r['final_train_t']['success_rate']:.3f} | " if r.get("final_train_t") else "– | "
        lines.append(f"| {r['algo']}-s{r['seed']} | {r['eval']['success_rate']:.3f} | "
                     f"{train_quarter(r, True):.3f} | {final_cell}{sum(r['replay_injections'])} | {r['seconds']} |")
    lines += ["", f"Tasks: {', '.join(report['tasks'])}"]
    if report.get("missing_runs"):
        lines[1:1] = ["", f"**Partial report: {len(report['missing_runs'])} run(s) not finished** "
                      f"({', '.join(report['missing_runs'])}); the figures cover the finished ones only."]
    return "\n".join(lines) + "\n"


def report_digest(report: dict[str, Any]) -> str:
    """The seed-determined numbers of a comparison, rounded (what nbval compares)."""
    rows = [f"warm start eval {report['warm_start_eval']['success_rate']:.3f}, tasks kept {len(report['tasks'])}"]
    for r in report["runs"]:
        rows.append(f"{r['algo']}-s{r['seed']}: eval {r['eval']['success_rate']:.3f}, "
                    f"injections {sum(r['replay_injections'])}")
    return "\n".join(rows)
