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
5. **transfer** (`compare.transfer_samples_per_task` > 0): the warm start and every final policy
   on fresh layouts of the trained tasks (`miniwob/click-test` for `miniwob/click-test@0`), at the
   training temperature, the same episodes for all -> `eval_transfer/` (the experiment's and each run's).
6. **report**: per arm the mean with a bootstrap 95% interval over seeds; paired differences per
   seed with an exact paired permutation test (and a sign test) and the seeds a 5-point difference
   would need; per step the share of all-failed groups, the injections and their age (did replay
   have anything to do?); `report.json`, `report.md`, `comparison.png`.

Every stage is skipped when its result exists, and a run resumes from its last checkpoint, so
rerunning the same command (now or later, on the same machine) continues where it stopped; with
`compare.archive` the finished runs' records outlive the run directory (a fresh checkout makes
the stages again, checks them against the archive's `stages.json` and runs only what is
missing). The replay buffer starts empty in every arm (`train.demo_replay` is forced to 0): ARPO's buffer
holds only the policy's own successes, as in the paper. The one exception is an arm that asks for
it: `arpo_seeded` starts with the successes task selection found (`algo.replay.seed_from:
selection`, which `run_config` points at this experiment's selection trajectories).

This module is the stages, in the order `run_comparison` runs them, and the caching that lets a
stage be skipped (a stage's directory is reused only if it was made with the same setting). The
statistics are `evaluation.stats`; the report's text is `viz.report`, its figure `viz.plots`.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from arpo_lib import build
from arpo_lib.evaluation.stats import arm_statistics, paired_comparison
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, config_changes, config_from_dict, flat_dict, read_saved_config
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import atomic_write_text, read_jsonl
from arpo_lib.run.registry import COMPARISON_ARMS
from arpo_lib.viz.report import report_digest, report_markdown

log = logging.getLogger(__name__)

# report_markdown and report_digest live in viz.report; the notebook calls them through this module.
__all__ = ["build_warm_start_model", "comparison_report", "evaluate_model", "finished_runs", "report_digest", "report_markdown",
           "require_same_setting", "run_arm", "run_comparison", "run_config", "selection_stage", "setting_changes",
           "eval_config", "transfer_stage", "transfer_tasks", "warm_start_stage"]

PAIRS = (("arpo", "grpo"), ("arpo_tis", "arpo"), ("arpo_tis", "grpo"), ("arpo_seeded", "arpo"),
         ("arpo_seeded", "grpo"), ("arpo_async1", "arpo_served"), ("arpo_async1_plain", "arpo_served"),
         ("arpo_async1_plain", "arpo_async1"))
"""Paired comparisons the report makes (first minus second), where both arms ran."""


def run_comparison(cfg: RunConfig, *, report_only: bool = False) -> dict[str, Any]:
    """All stages; returns the report (also written to report.json / report.md / comparison.png).

    `report_only`: run nothing; report the runs that have finished so far (a long experiment can
    be looked at while it runs, or after it was stopped). The report then names the missing runs
    (`missing_runs`). RuntimeError if the warm start, selection or baseline evaluations, or every
    run, are not finished yet."""
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
    warm_transfer = transfer_stage(cfg, model_dir, tasks, cfg.run_dir / "eval_transfer", run=not report_only)
    if report_only:
        runs, missing = finished_runs(cfg)
    else:
        archive = archive_dir(cfg)
        if archive:
            check_archived_stages(archive, stage_fingerprint(cfg, model_dir, tasks, warm, warm_train, warm_transfer))
            restore_archived_runs(cfg, archive)
        runs = []
        for seed in cfg.compare.seeds:
            for algo in cfg.compare.algos:
                runs.append(run_arm(cfg, algo, seed, model_dir, tasks))
                if archive:
                    archive_run(cfg.run_dir / f"{algo}-s{seed}", archive)
        missing = []
    report = comparison_report(cfg, warm, runs, tasks, warm_train=warm_train, warm_transfer=warm_transfer)
    report["missing_runs"] = missing
    report["seconds_total_this_call"] = round(time.monotonic() - t0, 1)
    write_report(cfg.run_dir, report)
    if not report_only and archive_dir(cfg):
        write_report(archive_dir(cfg), report)  # type: ignore[arg-type]
    return report


def _require_finished_stages(cfg: RunConfig) -> None:
    """RuntimeError naming what is missing unless the warm start, the selection, both baseline
    evaluations and at least one run have finished (what `--report-only` reads, running nothing)."""
    stages = [cfg.run_dir / "warm_start" / "done.json", cfg.run.selection / layout.SELECTION_RESULT,
              cfg.run_dir / "eval_warm_start" / layout.EVAL_RESULTS,
              cfg.run_dir / "eval_warm_start_train" / layout.EVAL_RESULTS]
    absent = [str(p) for p in stages if not p.is_file()]
    if absent:
        raise RuntimeError(f"nothing to report in {cfg.run_dir} yet: stages not finished: {', '.join(absent)}")
    if not finished_runs(cfg)[0]:
        raise RuntimeError(f"nothing to report in {cfg.run_dir} yet: no run has finished")


# ------------------------------------------------------------------------- stage 1: warm start

def warm_start_stage(cfg: RunConfig) -> Path:
    """SFT on scripted demonstrations once; returns the saved model directory."""
    model_dir = cfg.run_dir / "warm_start" / "model"
    ws_cfg = _derive(cfg, "warm_start", **{"train.steps": 0, "train.demo_replay": 0})
    require_same_setting(ws_cfg, free=WARM_START_FREE, only=WARM_START_SETTING)
    if _done(cfg.run_dir / "warm_start" / "done.json"):
        return model_dir
    with build.trainer(ws_cfg, resume=ws_cfg.run.config.exists()) as trainer:
        t0 = time.monotonic()
        losses = trainer.warm_start()
        trainer.backend.save_policy(model_dir)
    atomic_write_text(cfg.run_dir / "warm_start" / "done.json", json.dumps(
        {"steps": len(losses), "loss_first": losses[0] if losses else None,
         "loss_last": losses[-1] if losses else None, "seconds": round(time.monotonic() - t0, 1)}))
    return model_dir


def build_warm_start_model(recipe: RunConfig, out: Path, progress: bool = True) -> Path:
    """A warm-started model made once and kept at `out` (a Hugging Face model directory): the
    warm start of `recipe` (its `warm_start.*` on its `env.tasks` from its `model.path`, as the
    experiment's stage 1), for runs that start from it with `warm_start.steps=0` (the smoke run:
    every seed from the same weights). Kept with `warm_start.json` (losses, seconds, the recipe)
    and a `.complete` marker; made again when the recipe changed. Returns `out`."""
    import shutil

    out = Path(out)
    settings = {k: v for k, v in flat_dict(recipe.to_dict()).items() if _matches(k, WARM_START_SETTING)}
    record = out / "warm_start.json"
    if (out / ".complete").is_file() and record.is_file():
        if json.loads(record.read_text()).get("recipe") == settings:
            return out
        log.info("%s was made with another warm-start recipe: making it again", out)
    build_dir = out.with_name(out.name + ".build")
    cfg = _derive(recipe, "build", **{"out_dir": str(build_dir), "logging.progress": progress})
    if build_dir.exists() and not (cfg.run_dir / "warm_start" / "done.json").is_file():
        shutil.rmtree(build_dir)  # an interrupted build: start over (its steps are not resumable)
    log.info("making the warm start %s once (%d demonstrations per task, %d SFT steps)", out,
             recipe.warm_start.demos_per_task, recipe.warm_start.steps)
    model = warm_start_stage(cfg)
    done = json.loads((cfg.run_dir / "warm_start" / "done.json").read_text())
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model, out)
    atomic_write_text(record, json.dumps({**done, "recipe": settings}, indent=1))
    (out / ".complete").touch()
    shutil.rmtree(build_dir)
    return out


# --------------------------------------------------------------------- stage 2: task selection

def selection_stage(cfg: RunConfig, model_dir: Path) -> list[str]:
    """ARPO's task selection with the warm-started policy; returns the kept tasks."""
    from arpo_lib.evaluation.task_selection import load_selection
    from arpo_lib.workflows.evaluate import run_task_selection

    out = cfg.run.selection
    if not (out / layout.SELECTION_RESULT).is_file():
        # its trajectories are kept: the seeded arm's buffer starts with their successes
        sel_cfg = _derive(cfg, "selection", **{"model.path": str(model_dir), "select.save_trajectories": True})
        run_task_selection(sel_cfg, out)
    kept = load_selection(out)
    if not kept:
        raise RuntimeError(f"task selection kept no task ({out / 'selection.md'}): the warm start is too weak "
                           "for RL to have any signal; train it longer (warm_start.steps) or raise select.k")
    return kept


# -------------------------------------------- stage 3: evaluations (baselines, final policies)

def evaluate_model(cfg: RunConfig, model_dir: Path, tasks: list[str], out: Path,
                   temperature: float | None = None, samples_per_task: int | None = None) -> dict[str, Any]:
    """The fixed evaluation protocol (eval.*, at `temperature` and with `samples_per_task` when
    given) of a saved model on `tasks`; cached in out/results.json."""
    from arpo_lib.evaluation.evaluate import evaluate_run

    done = _done(out / layout.EVAL_RESULTS)
    if done:
        return done
    ev_cfg = build.prepare(eval_config(cfg, model_dir, tasks, out, temperature, samples_per_task))
    with build.engine(ev_cfg, protocol=ev_cfg.eval.protocol) as engine:
        result = evaluate_run(engine, ev_cfg, out, description=f"eval {out.name}")
    return result.to_dict()


def eval_config(cfg: RunConfig, model_dir: Path, tasks: list[str], out: Path, temperature: float | None = None,
                samples_per_task: int | None = None) -> RunConfig:
    """The config of one of the experiment's evaluations (`evaluate_model`): `model_dir` on exactly
    `tasks` (an instance stays one instance, a task without `@` gets a fresh layout per episode:
    env.instances_per_task does not apply)."""
    changes: dict[str, Any] = {"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None,
                               "env.instances_per_task": 0}
    if temperature is not None:  # a measure at another temperature: the run's own protocol
        changes.update({"eval.temperature": temperature, "eval.protocol": "run"})
    if samples_per_task is not None:
        changes["eval.samples_per_task"] = samples_per_task
    return _derive(cfg, out.name, **changes)


def transfer_tasks(tasks: list[str]) -> list[str]:
    """The tasks of fixed instances on fresh layouts: `miniwob/click-test@0` -> `miniwob/click-test`
    (each once, in order); a task without an instance is its own."""
    from arpo_lib.envs import split_instance

    return list(dict.fromkeys(split_instance(t)[0] for t in tasks))


def transfer_stage(cfg: RunConfig, model_dir: Path, tasks: list[str], out: Path,
                   run: bool = True) -> dict[str, Any] | None:
    """`model_dir`'s success on fresh layouts of `tasks` (`transfer_tasks`) at the training
    temperature, `compare.transfer_samples_per_task` episodes each with the evaluation's seeds
    (every model gets the same layouts); cached in out/. None when it is off, or (`run=False`)
    not measured yet."""
    n = cfg.compare.transfer_samples_per_task
    if n <= 0 or (not run and not (out / layout.EVAL_RESULTS).is_file()):
        return None
    return evaluate_model(cfg, model_dir, transfer_tasks(tasks), out, temperature=cfg.rollout.temperature,
                          samples_per_task=n)


# --------------------------------------------------------------------------- stage 4: the runs

def run_config(cfg: RunConfig, algo: str, seed: int, model_dir: Path, tasks: list[str]) -> RunConfig:
    """The config of one run of the experiment: arm `algo`, training seed `seed`, from the warm
    start in `model_dir` on the kept `tasks` (its directory: `<experiment>/<algo>-s<seed>`)."""
    arm = dict(COMPARISON_ARMS[algo])
    if arm.get("algo.replay.seed_from") == SEED_FROM_SELECTION:
        trajectories = cfg.run.selection / "trajectories"
        if not trajectories.is_dir():
            raise RuntimeError(f"arm {algo!r} seeds its replay buffer with task selection's successes, but "
                               f"{trajectories} does not exist: this experiment's selection was made without "
                               "keeping its trajectories; run the experiment under another name (name=...)")
        arm["algo.replay.seed_from"] = str(trajectories)
    return _derive(cfg, f"{algo}-s{seed}", **{"model.path": str(model_dir), "env.tasks": tasks, "eval.tasks": None,
                                              **arm, "train.seed": seed,
                                              "warm_start.steps": 0, "warm_start.demos_per_task": 0,
                                              "train.demo_replay": 0,
                                              "train.tasks_per_batch": min(cfg.train.tasks_per_batch, len(tasks))})


SEED_FROM_SELECTION = "selection"
"""An arm's `algo.replay.seed_from` value meaning "this experiment's task-selection trajectories"."""


def run_arm(cfg: RunConfig, algo: str, seed: int, model_dir: Path, tasks: list[str]) -> dict[str, Any]:
    """One RL run from the warm start, then its final evaluation; resumable, cached in final.json."""
    run_cfg = run_config(cfg, algo, seed, model_dir, tasks)
    final = run_cfg.run_dir / "final.json"
    require_same_setting(run_cfg)
    if _done(final):
        return _with_transfer(cfg, _with_final_at_train_temperature(cfg, _done(final), final, tasks),  # type: ignore[arg-type]
                              final, tasks)
    name = run_cfg.name
    resume = run_cfg.run.metrics.exists()
    t0 = time.monotonic()
    with build.trainer(run_cfg, resume=resume) as trainer:
        log.info("[compare] %s: %s (%d steps on %d tasks)", name,
                 f"resuming at step {trainer.step}" if resume else "starting", run_cfg.train.steps, len(tasks))
        trainer.train()
        trainer.backend.save_policy(run_cfg.run_dir / "final_model")
    evaluation = evaluate_model(cfg, run_cfg.run_dir / "final_model", tasks, run_cfg.run_dir / "eval_final")
    record = {"algo": algo, "seed": seed, "eval": _eval_summary(evaluation),
              "seconds": round(time.monotonic() - t0, 1), **_train_summary(run_cfg.run_dir)}
    atomic_write_text(final, json.dumps(record, indent=1))
    return _with_transfer(cfg, _with_final_at_train_temperature(cfg, record, final, tasks), final, tasks)


def _with_transfer(cfg: RunConfig, record: dict[str, Any], final: Path, tasks: list[str]) -> dict[str, Any]:
    """`record` with `transfer` (`transfer_stage` of the final policy, in eval_transfer/) when
    compare.transfer_samples_per_task > 0; measured once, recorded in final.json."""
    if cfg.compare.transfer_samples_per_task <= 0 or "transfer" in record:
        return record
    _require_final_model(final, "transfer")
    result = transfer_stage(cfg, final.parent / "final_model", tasks, final.parent / "eval_transfer")
    assert result is not None
    record = {**record, "transfer": {**_eval_summary(result),
                                     "by_task": {t["task"]: t["success_rate"] for t in result.get("tasks") or []}}}
    atomic_write_text(final, json.dumps(record, indent=1))
    return record


def _with_final_at_train_temperature(cfg: RunConfig, record: dict[str, Any], final: Path,
                                     tasks: list[str]) -> dict[str, Any]:
    """`record` with `final_train_t` (the final policy at the training temperature on the training
    tasks, `compare.baseline_samples_per_task` episodes each, the baseline's episode seeds) when
    compare.final_at_train_temperature is on; measured once (cached in eval_final_t/, recorded in
    final.json), also for runs that finished before the switch was turned on."""
    if not cfg.compare.final_at_train_temperature or "final_train_t" in record:
        return record
    _require_final_model(final, "final_at_train_temperature")
    result = evaluate_model(cfg, final.parent / "final_model", tasks, final.parent / "eval_final_t",
                            temperature=cfg.rollout.temperature,
                            samples_per_task=cfg.compare.baseline_samples_per_task)
    record = {**record, "final_train_t": {**_eval_summary(result),
                                          "by_task": {t["task"]: t["success_rate"] for t in result.get("tasks") or []}}}
    atomic_write_text(final, json.dumps(record, indent=1))
    return record


def _require_final_model(final: Path, measure: str) -> None:
    """RuntimeError where a finished run lacks a measure and its final policy (a run restored from
    an archive keeps only its record): the measure cannot be added to it."""
    if not (final.parent / "final_model").is_dir():
        raise RuntimeError(f"{final.parent.name} finished without the measure {measure!r} and its final policy is not "
                           f"here ({final.parent / 'final_model'}: a run restored from compare.archive keeps only its "
                           "record): measure it where the run was made, or run the experiment under another name")


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
        "replay_age_by_step": [m["replay_age_mean"] if m.get("replay_injections") else None for m in lines],
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


# ------------------------------------------------------------------------- stage 5: the report

def comparison_report(cfg: RunConfig, warm: dict[str, Any], runs: list[dict[str, Any]], tasks: list[str],
                      warm_train: dict[str, Any] | None = None,
                      warm_transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study's numbers: per arm of `compare.algos` that ran, `evaluation.stats.arm_statistics`
    over its seeds (gains against `warm_train`, the warm start at the training temperature, or
    `warm` without it); paired (same seed) differences for each of `PAIRS` where both arms ran;
    the setting they were measured in, and the runs themselves."""
    warm_t = warm_train or warm
    arms: dict[str, Any] = {}
    for algo in cfg.compare.algos:
        rs = sorted((r for r in runs if r["algo"] == algo), key=lambda r: r["seed"])
        if rs:
            arms[algo] = arm_statistics(rs, warm, warm_t, warm_transfer)
    pairs = {f"{a}-{b}": paired_comparison(runs, a, b, sorted(set(arms[a]["seeds"]) & set(arms[b]["seeds"])))
             for a, b in PAIRS if a in arms and b in arms}
    return {"experiment": str(cfg.run_dir), "tasks": tasks, "steps": cfg.train.steps,
            "rollouts_per_step": cfg.train.tasks_per_batch * cfg.rollout.group_size,
            "eval": {"samples_per_task": cfg.eval.samples_per_task, "temperature": cfg.eval.temperature,
                     "seed": cfg.eval.seed, "train_temperature": cfg.rollout.temperature,
                     "protocol": cfg.eval.protocol},
            "warm_start_eval": _eval_summary(warm),
            "warm_start_train_temperature": _eval_summary(warm_train) if warm_train else None,
            "warm_start_train_by_task": {t["task"]: t["success_rate"] for t in (warm_train or warm).get("tasks") or []},
            "warm_start_transfer": ({**_eval_summary(warm_transfer), "tasks": transfer_tasks(tasks)}
                                    if warm_transfer else None),
            "arms": arms, "paired": pairs, "runs": runs,
            **({"preregistered": True} if cfg.compare.preregistered else {})}


def write_report(run_dir: Path, report: dict[str, Any]) -> None:
    """report.json, report.md (`viz.report`), comparison.png and instances.png (`viz.plots`) in
    the experiment's directory."""
    from arpo_lib.viz.figures import save_figure  # matplotlib: only here
    from arpo_lib.viz.study_plots import plot_comparison, plot_instance_curves

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=1))
    atomic_write_text(run_dir / "report.md", report_markdown(report))
    save_figure(plot_comparison(report), run_dir / "comparison.png")
    save_figure(plot_instance_curves(report), run_dir / "instances.png")


# ------------------------------------- the archive: results kept across machines and checkouts

ARCHIVE_STAGES = "stages.json"
ARCHIVED_RUN_FILES = ("final.json", layout.CONFIG)
"""What the archive keeps of a finished run: its record (every number the report reads) and its
config (the setting check of a restored run)."""


def archive_dir(cfg: RunConfig) -> Path | None:
    return Path(cfg.compare.archive) if cfg.compare.archive else None


WEIGHTS_RTOL = 1e-4
"""Two warm starts are the same up to rounding when every tensor's norm agrees to this relative
tolerance (the same recipe in another kind of process differed in the 7th digit of the loss)."""


def stage_fingerprint(cfg: RunConfig, model_dir: Path, tasks: list[str], warm: dict[str, Any],
                      warm_train: dict[str, Any] | None, warm_transfer: dict[str, Any] | None) -> dict[str, Any]:
    """What the experiment's runs start from, in a form two checkouts can compare: the warm start's
    weights (sha256 of its weight files, and every tensor's norm), the instances selection kept
    with every candidate's successes, the baselines' success rates, and the host's numerics."""
    import hashlib

    from safetensors import safe_open

    from arpo_lib.run.seeding import numerics_fingerprint

    digest, norms = hashlib.sha256(), {}
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                norms[name] = float(weights.get_tensor(name).double().norm())
    selection = json.loads((cfg.run.selection / layout.SELECTION_RESULT).read_text())
    return {"warm_start_weights_sha256": digest.hexdigest(), "warm_start_weight_norms": norms, "kept": list(tasks),
            "selection_successes": {t["task"]: t["successes"] for t in selection.get("tasks") or []},
            "baselines": {name: (result or {}).get("success_rate")
                          for name, result in (("eval_warm_start", warm), ("eval_warm_start_train", warm_train),
                                               ("eval_transfer", warm_transfer))},
            "numerics": numerics_fingerprint()}


def check_archived_stages(archive: Path, fingerprint: dict[str, Any]) -> None:
    """Writes `fingerprint` to `archive`/stages.json the first time. Afterwards RuntimeError unless
    the warm start made now is the archived one up to rounding (`WEIGHTS_RTOL`) and selection kept
    the same instances; where the selection's counts or the baselines differ (sampling from
    weights that differ in the last digits), a warning says so and the runs are pooled."""
    path = archive / ARCHIVE_STAGES
    if not path.is_file():
        archive.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(fingerprint, indent=1))
        return
    archived = json.loads(path.read_text())
    differ = [] if archived.get("kept") == fingerprint["kept"] else ["kept"]
    if archived.get("warm_start_weights_sha256") != fingerprint["warm_start_weights_sha256"]:
        old, new = archived.get("warm_start_weight_norms") or {}, fingerprint["warm_start_weight_norms"]
        if old.keys() != new.keys() or any(abs(old[k] - new[k]) > WEIGHTS_RTOL * max(abs(old[k]), 1e-12) for k in new):
            differ.insert(0, "warm_start_weights")
    if differ:
        raise RuntimeError(
            f"the warm start or selection made now differ from those of the runs archived in {archive} "
            f"({', '.join(differ)}): those runs came from other weights, so new runs could not be pooled with them. "
            f"The archive was made on a host with numerics {archived.get('numerics')!r}, this one has "
            f"{fingerprint['numerics']!r} (the same recipe gives other weights on another host: docs/learning.md, "
            "section 7). Run on such a host, or start a new archive (compare.archive=...)")
    drift = [k for k in ("selection_successes", "baselines") if archived.get(k) != fingerprint[k]]
    if drift:
        log.warning("[compare] the warm start made now equals the archived one up to rounding, but %s differ "
                    "(archived %s, now %s): the archived runs are pooled with new ones; the report's baselines "
                    "are this call's", ", ".join(drift), {k: archived.get(k) for k in drift},
                    {k: fingerprint[k] for k in drift})


def restore_archived_runs(cfg: RunConfig, archive: Path) -> list[str]:
    """Copies every archived run of this experiment's seeds and arms that the run directory has not
    finished (final.json and config.yaml) into it; returns their names. A restored run is then
    checked like any other (`require_same_setting`) and not run again."""
    restored = []
    for seed in cfg.compare.seeds:
        for algo in cfg.compare.algos:
            name = f"{algo}-s{seed}"
            source, target = archive / name, cfg.run_dir / name
            if not (source / "final.json").is_file() or (target / "final.json").is_file():
                continue
            _copy_run_record(source, target)
            restored.append(name)
    if restored:
        log.info("[compare] restored %d finished runs from %s: %s", len(restored), archive, ", ".join(restored))
    return restored


def archive_run(run_dir: Path, archive: Path) -> None:
    """A finished run's final.json and config.yaml into `archive`/<run name>/."""
    _copy_run_record(run_dir, archive / run_dir.name)


def _copy_run_record(source: Path, target: Path) -> None:
    """`ARCHIVED_RUN_FILES` of the run in `source` into `target` (made if absent)."""
    target.mkdir(parents=True, exist_ok=True)
    for file in ARCHIVED_RUN_FILES:
        if (source / file).is_file():
            atomic_write_text(target / file, (source / file).read_text())


# ------------------------------------------- a stage's cache: reused for the same setting only

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


SETTING_FREE = ("out_dir", "name", "model.path", "algo.replay.seed_from", "compare.", "logging.")
"""Config keys (or prefixes) that do not change what a run of the experiment computes: where it
lives (and so where its warm start and selection are), the experiment's seed list and arms,
logging. Every other key is part of a run's setting."""


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
    saved = run_cfg.run.config
    if not saved.is_file():
        return
    changes = setting_changes(saved, run_cfg, free, only)
    if changes:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:8])
        raise RuntimeError(f"{run_cfg.run_dir} holds a run made with another setting ({shown}"
                           f"{', ...' if len(changes) > 8 else ''}): give the experiment another name "
                           f"(name=...) or move that run away")
