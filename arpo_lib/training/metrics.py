"""What a training step reports, and where it goes.

The metrics of a step are computed by the helpers here from what the step produced (the
trajectories, the groups, the update's statistics), one line per step in <run>/metrics.jsonl
(`viz.plots` and `workflows.print_step` read it) and in the tracker (wandb when enabled).
`RunRecords` writes a run's records: config.yaml, the metric lines and each step's groups.json,
by rank 0 alone; on resume it drops the lines of steps that will be redone.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from arpo_lib.envs.workers.base import failure_cause
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, config_changes, read_saved_config, save_config
from arpo_lib.run.records import append_jsonl, read_jsonl
from arpo_lib.run.tracking import Media, Tracker
from arpo_lib.training.checkpoint import drop_records_after
from arpo_lib.types import EpisodeStatus, Group, Trajectory

if TYPE_CHECKING:
    from arpo_lib.training.backend import Plan, TrainingBackend

log = logging.getLogger(__name__)


def mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def replay_ages(groups: list[Group], weights_version: int) -> dict[str, Any]:
    """How stale the replayed trajectories of this batch are, in weight versions."""
    ages = [weights_version - t.policy_version for g in groups for t in g.trajectories if t.replayed]
    return {"replay_age_mean": mean(ages), "replay_age_max": max(ages, default=0)}


def weight_stats(weights: list[torch.Tensor], cap: float) -> dict[str, Any]:
    """Truncated importance weights of the replayed tokens: mean, max, share at the cap."""
    if not weights:
        return {}
    w = torch.cat(weights)
    return {"is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()),
            "is_capped_share": float((w >= cap).float().mean())}


def is_weight_stats(items: list[tuple[Any, float, Trajectory]], plans: list["Plan"],
                    is_weights: dict[int, torch.Tensor], backend: "TrainingBackend", cap: float) -> dict[str, Any]:
    """`weight_stats` of the replayed sequences an update trains on (`items`, each (segment,
    advantage, trajectory); the live micro-batches of `plans`), over every process."""
    live = {id(s) for plan in plans for micro, alive in plan if alive for s, _ in micro}
    counted = [is_weights[id(s)] for s, _, _ in items if id(s) in is_weights and id(s) in live]
    return weight_stats([w for ws in backend.gather_lists(counted) for w in ws], cap)


class UpdateMetrics:
    """An update's statistics as it runs: per mini-batch (`minibatch`) its loss, clip fraction and
    KLs (token means, summed over ranks), gradient norm and tokens; the loss, norm and tokens count
    only for the optimizer steps taken, the clip fraction and KLs for every mini-batch this process
    ran sequences of. `result()` is the update's part of the step's metrics."""

    def __init__(self, sequences: int, groups: list[Group], weights_version: int):
        self.stats: dict[str, Any] = {
            "loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "tokens": 0, "sequences": sequences,
            "optimizer_steps": 0, "skipped_steps": 0, "approx_kl": 0.0, "kl": 0.0,
            **replay_ages(groups, weights_version)}
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.clips: list[float] = []
        self.kls: list[float] = []
        self.ref_kls: list[float] = []

    @property
    def optimizer_steps(self) -> int:
        return self.stats["optimizer_steps"]

    def add(self, more: dict[str, Any]) -> None:
        self.stats.update(more)

    def minibatch(self, sums: list[float], *, ran: bool, norm: float, tokens: int) -> None:
        """`sums`: the mini-batch's loss, clip fraction, approx. KL and KL to the reference;
        `ran`: this process ran sequences of it; a finite `norm`: its optimizer step was taken."""
        loss, clip, kl, ref_kl = sums
        if ran:
            self.clips.append(clip)
            self.kls.append(kl)
            self.ref_kls.append(ref_kl)
        if math.isfinite(norm):
            self.losses.append(loss)
            self.norms.append(norm)
            self.stats["optimizer_steps"] += 1
            self.stats["tokens"] += tokens
        else:
            self.stats["skipped_steps"] += 1

    def result(self) -> dict[str, Any]:
        return {**self.stats, "loss": mean(self.losses), "clip_fraction": mean(self.clips),
                "grad_norm": mean(self.norms), "approx_kl": mean(self.kls), "kl": mean(self.ref_kls)}


def rollout_metrics(tasks: list[str], trajs: list[Trajectory], groups: list[Group]) -> dict[str, Any]:
    """Success, scores and failures of a rollout batch (infrastructure failures left out of the
    rates; `env_error_causes` counts them by cause: `envs.workers.base.failure_cause`)."""
    fresh = [t for t in trajs if t.ok]
    return {
        "success_rate": mean([float(t.success) for t in fresh]),
        "success_by_task": {task: [sum(t.success for t in fresh if t.task == task),
                                   sum(t.task == task for t in fresh)] for task in dict.fromkeys(tasks)},
        "mean_task_score": mean([t.task_score for t in fresh]),
        "mean_reward": mean([t.reward for t in fresh]),
        "format_error_rate": mean([float(not t.format_ok) for t in fresh]),
        "mean_steps": mean([t.num_steps for t in fresh]),
        "env_errors": sum(t.status == EpisodeStatus.ENV_ERROR for t in trajs),
        "env_error_causes": dict(Counter(failure_cause(t.error) for t in trajs if t.status == EpisodeStatus.ENV_ERROR)),
        "setup_failed": sum(t.status == EpisodeStatus.SETUP_FAILED for t in trajs),
        "setup_failures": sum(bool(t.setup_failures) for t in trajs),
        "checker_errors": sum(t.checker_error is not None for t in fresh),
        "all_failed_groups": mean([float(g.all_failed) for g in groups]),
        "replay_injections": sum(g.injected for g in groups),
    }


def step_metrics(step: int, tasks: list[str], trajs: list[Trajectory], groups: list[Group], *, replay_size: int,
                 env_steps: int, lr: float, update: dict[str, Any], seconds_rollout: float, seconds_update: float,
                 extra: dict[str, Any]) -> dict[str, Any]:
    """A step's line of metrics.jsonl; `extra`: the rollout servers' counters and the evaluation's."""
    return {"step": step, "tasks": tasks, **rollout_metrics(tasks, trajs, groups), "replay_size": replay_size,
            "env_steps": env_steps, "env_steps_per_s": env_steps / max(seconds_rollout, 1e-9), "lr": lr, **update,
            "seconds_rollout": round(seconds_rollout, 3), "seconds_update": round(seconds_update, 3), **extra}


class RunRecords:
    """A run's records, written by rank 0 alone: config.yaml, a metric line per step
    (metrics.jsonl and the tracker), each step's groups.json. Reads `logging.*`."""

    def __init__(self, cfg: RunConfig, backend: "TrainingBackend", media: Media | None = None):
        self.cfg, self.backend, self.media = cfg, backend, media
        self.run = cfg.run
        self.run.root.mkdir(parents=True, exist_ok=True)
        self.progress = cfg.logging.progress and backend.is_main
        """Show progress bars (logging.progress, on rank 0 only)."""
        self.tracker: Tracker | None = None

    def start(self, step: int, resume: bool) -> None:
        """Before this process's first step (`step`: the checkpoint's): on resume the lines of the
        steps that will be redone go; the config is recorded; rank 0 starts the tracker."""
        if self.backend.is_main:
            if resume:
                drop_records_after(self.run, step)
            self._record_config(step, resume)
        self.backend.barrier()
        if self.backend.is_main:  # the others never log to wandb
            self.tracker = Tracker(self.cfg, self.media)

    def _record_config(self, step: int, resume: bool) -> None:
        """Write the run's config.yaml. A resume with a changed config keeps the one the run had
        until now as config.until_step_<N>.yaml and logs the changed keys, so the record of how
        steps 1..N were made is not overwritten."""
        path = self.run.config
        if resume and path.is_file():
            changes = config_changes(read_saved_config(path), self.cfg)
            if changes:
                kept = self.run.config_until(step)
                path.replace(kept)
                log.warning("resuming %s at step %d with a changed config (%s); the config until now is kept in %s",
                            self.run.root, step, ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()),
                            kept.name)
        save_config(self.cfg, path)

    @contextlib.contextmanager
    def progress_bar(self, total: int, initial: int, description: str) -> Iterator[Callable[[dict[str, Any]], None]]:
        """A bar over the training steps (when `progress`); call what it yields with each step's metrics."""
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=initial, desc=description, disable=not self.progress)

        def shown(metrics: dict[str, Any]) -> None:
            bar.update(1)
            bar.set_postfix(success=f"{metrics['success_rate']:.2f}", loss=f"{metrics['loss']:.4f}",
                            injected=metrics["replay_injections"])
        try:
            yield shown
        finally:
            bar.close()

    def groups(self, step: int, groups: list[Group]) -> None:
        """Step `step`'s groups as trained on (groups.json: the group view reads it)."""
        if self.backend.is_main:
            layout.write_groups(self.run.groups(step), [g.record() for g in groups])

    def logged(self, step: int) -> bool:
        """Whether step `step`'s metric line is in metrics.jsonl (rank 0 reads; the others are told)."""
        found = (self.backend.is_main and self.run.metrics.exists()
                 and any(m.get("step") == step for m in read_jsonl(self.run.metrics)))
        return bool(self.backend.broadcast(found))

    def log(self, metrics: dict[str, Any]) -> None:
        if self.backend.is_main:
            append_jsonl(self.run.metrics, metrics)
        if self.tracker is not None:
            self.tracker.log(metrics, step=metrics["step"])

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


def staleness_metrics(trajs: list[Trajectory], version: int) -> dict[str, float]:
    """How many weight versions behind `version` (the weights this step's update starts from) the
    responses of a batch were sampled: per response (its step's recorded version, else its
    trajectory's), the mean and max, and the fraction that were stale at all; per sampled token
    (what the loss weighs), the mean and the stale fraction. A response's tokens are its run of
    trained tokens in the trajectory's segments (`response_token_counts`)."""
    ages, tokens = [], []
    for t in trajs:
        if not t.ok:
            continue
        counts = response_token_counts(t)
        for s, n in zip(t.steps, counts):
            ages.append(version - (s.weights_version if s.weights_version is not None else t.policy_version))
            tokens.append(n)
    if not ages:
        return {}
    out = {"staleness_mean": sum(ages) / len(ages), "staleness_max": float(max(ages)),
           "stale_fraction": sum(a > 0 for a in ages) / len(ages)}
    if sum(tokens):
        out["staleness_token_mean"] = sum(a * n for a, n in zip(ages, tokens)) / sum(tokens)
        out["stale_token_fraction"] = sum(n for a, n in zip(ages, tokens) if a > 0) / sum(tokens)
    return out


def response_token_counts(traj: Trajectory) -> list[int]:
    """The sampled tokens of each of `traj`'s responses, in step order: the runs of the loss mask
    over its segments (a response is one run). Where the runs do not pair with the steps (no token
    data kept), each response counts 1, so token figures fall back to per-response ones."""
    runs: list[int] = []
    for segment in traj.segments:
        previous = 0
        for m in segment.loss_mask:
            if m and not previous:
                runs.append(0)
            if m:
                runs[-1] += 1
            previous = m
    return runs if len(runs) == len(traj.steps) else [1] * len(traj.steps)
