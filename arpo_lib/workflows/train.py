"""The training notebooks' steps: open the run's trainer (resuming, or launched under torchrun),
report each step on one line, and sum the run up when it ends."""
from __future__ import annotations

import logging
from typing import Any

from arpo_lib import build
from arpo_lib.run.config import RunConfig
from arpo_lib.run.records import read_jsonl
from arpo_lib.training.contracts import RunTrainer

log = logging.getLogger(__name__)


def open_trainer(cfg: RunConfig) -> RunTrainer:
    """A Trainer for the run: resumes from its last checkpoint when the run directory exists.
    With train.nproc_per_node > 1 a `LaunchedTrainer`: the run trains in that many processes under
    torchrun, and its `train` streams their progress here (arpo_lib/training/launch.py)."""
    from arpo_lib.training.checkpoint import latest_checkpoint
    from arpo_lib.training.distributed import Ranks
    from arpo_lib.training.launch import LaunchedTrainer

    check_fit(cfg)
    if cfg.train.nproc_per_node > 1 and not Ranks.under_torchrun():
        launched = LaunchedTrainer(cfg, cfg.train.nproc_per_node)
        log.info("%s on %d processes: %s", cfg.run_dir, cfg.train.nproc_per_node, " ".join(launched.command()))
        return launched
    run = cfg.run
    resume = run.metrics.exists() or latest_checkpoint(run.checkpoints) is not None
    trainer = build.trainer(cfg, resume=resume)
    log.info("%s %s at step %d of %d (%s, %d tasks)", "resuming" if resume else "starting", cfg.run_dir, trainer.step,
             cfg.train.steps, "ARPO" if trainer.replay.enabled else "GRPO", len(cfg.env.tasks))
    return trainer


def check_fit(cfg: RunConfig) -> None:
    """Before a run trains on a GPU: the memory planner's verdict for this GPU (`train.plan_check`).
    Raises `training.plan.DoesNotFit` with the plan and its levers when the run would not fit; a
    model whose shape the planner cannot read (no config.json at hand) is let through, said so."""
    from arpo_lib.training.plan import require_fit

    if not cfg.train.plan_check:
        return
    try:
        result = require_fit(cfg)
    except FileNotFoundError as exc:
        log.warning("not checking whether the run fits the GPU: %s", exc)
        return
    if result is not None:
        log.info("the memory planner: peak %s, %.1f GiB per GPU of %.0f GiB: fits", result.peak.name,
                 result.peak.total / 2**30, result.gpu_memory / 2**30)


def print_step(metrics: dict[str, Any]) -> None:
    """A one-line progress report per training step (the trainer's `on_step` callback)."""
    line = (f"step {metrics['step']:>4}  success {metrics['success_rate']:.2f}  reward {metrics['mean_reward']:+.3f}  "
            f"all-failed {metrics['all_failed_groups']:.2f}  injected {metrics['replay_injections']}  "
            f"loss {metrics['loss']:+.4f}  ({metrics['seconds_rollout'] + metrics['seconds_update']:.1f} s)")
    if "eval_success_rate" in metrics:
        line += f"  | eval success {metrics['eval_success_rate']:.2f}"
    log.info(line)


def live_progress(trainer: RunTrainer) -> Any:
    """The training notebooks' `on_step`: a curve of training and evaluation success and replay
    injections that redraws in place after every step (steps before a resume included), then the
    step's line (`print_step`). Each rollout phase has its own progress bar (the engine's)."""
    from arpo_lib.viz.plots import LiveTraining

    return LiveTraining(trainer.run_dir, then=print_step)


def training_report(trainer: RunTrainer) -> str:
    """Final report of a training run: steps, success over time, evaluations, where things are."""
    metrics = read_jsonl(trainer.run.metrics)
    evals = [m for m in metrics if "eval_success_rate" in m]
    lines = [f"run: {trainer.run_dir}", f"steps: {trainer.step} / {trainer.cfg.train.steps}",
             f"replay buffer: {len(trainer.replay)} trajectories over {trainer.replay.stats().get('tasks_with_successes', 0)} tasks, "
             f"{sum(m['replay_injections'] for m in metrics)} injections"]
    if metrics:
        first, last = metrics[0], metrics[-1]
        lines.append(f"train success: first step {first['success_rate']:.2f}, last step {last['success_rate']:.2f}, "
                     f"mean {sum(m['success_rate'] for m in metrics) / len(metrics):.2f}")
    for m in evals:
        lines.append(f"eval at step {m['step']:>4}: success {m['eval_success_rate']:.2f}, pass@k {m['eval_pass_at_k']:.2f}, "
                     f"format errors {m['eval_format_error_rate']:.2f}")
    lines.append(f"checkpoints: {trainer.run.checkpoints}")
    return "\n".join(lines)

