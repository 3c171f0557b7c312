"""Evaluation: k samples per task with fixed seeds; success rate, pass@k, steps, format errors.

Trajectories are written in OSWorld's result layout, `<out>/<domain>/<task>/<sample>/`, with
`result.txt` holding the score, so OSWorld's own result-reading scripts work on them.
"""
from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from arpo_lib.envs import domain_of
from arpo_lib.evaluation.protocols import PROTOCOLS
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig
from arpo_lib.run.seeding import stable_seed
from arpo_lib.types import EpisodeRequest, EpisodeStatus, Trajectory, episode_requests


@dataclass
class TaskResult:
    task: str
    samples: int
    successes: int
    success_rate: float
    pass_at_k: float
    mean_score: float
    mean_steps: float
    format_error_rate: float
    env_errors: int
    unfinished: int = 0
    """Episodes without a result (EpisodeStatus.UNFINISHED): not counted in the rates."""


@dataclass
class EvalResult:
    tasks: list[TaskResult] = field(default_factory=list)
    success_rate: float = 0.0
    """Mean over valid episodes of all tasks."""
    pass_at_k: float = 0.0
    """Share of tasks solved at least once in k samples."""
    mean_steps: float = 0.0
    format_error_rate: float = 0.0
    env_errors: int = 0
    checker_errors: int = 0
    """Valid episodes whose checker raised (scored 0, counted in the success rate as failures).
    Under a protocol with `unfinished_on_error` such episodes are `unfinished` instead."""
    unfinished: int = 0
    """Episodes left without a result (the OSWorld fork's runner loses them to an exception): not
    in the rates, as the fork's result readers skip examples without result.txt; run them again
    with `unfinished_requests`."""
    setup_failed: int = 0
    """Episodes skipped because the task's set-up failed (OSWorld's `on_setup_failure: skip`): not
    in the rates; which tasks, in their trajectories' `setup_failures`."""
    episodes: int = 0
    seconds: float = 0.0
    env_steps: int = 0
    per_domain: dict[str, float] = field(default_factory=dict)
    protocol: str = "run"
    """The evaluation protocol (evaluation.protocols) the numbers were measured under."""
    max_new_tokens: int | None = None
    """The response cap the protocol's own was replaced with (eval.max_new_tokens); None = the
    protocol's cap (or model.max_new_tokens under one without a cap)."""
    tasks_total: int = 0
    """Tasks asked for (every task of the set)."""
    fork_acc: float = 0.0
    """The OSWorld fork's pass_at_n.py "Acc": tasks solved (any sample scoring > 0.5) over the tasks
    with at least one result. Its headline; comparable with ARPO's Table 1 under `osworld_uitars`."""
    fork_acc_over_all: float = 0.0
    """pass_at_n.py's "Acc over all": the same solved tasks over every task of the set."""
    fork_tasks_with_result: int = 0
    rerun: list[dict[str, Any]] = field(default_factory=list)
    """The passes that ran episodes without a result again: {"pass", "episodes", "still_without_result"}."""
    lead_with_fork_acc: bool = False
    """The table starts with the fork's figures (protocols that follow it)."""
    desktop_env: dict[str, Any] | None = None
    """Which desktop_env scored the OSWorld episodes (envs/osworld/build_info.py: its `label`, the
    version, a hash of its evaluator sources, whether it pauses the VM); None without OSWorld."""
    episodes_by_rank: list[int] | None = None
    """Spread over the training ranks (`Spread`): the episodes each rank played, reruns included
    (None: one process played them all)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, Any]:
        """The `eval_*` keys of a training step's metrics line."""
        return {"eval_success_rate": self.success_rate, "eval_pass_at_k": self.pass_at_k,
                "eval_format_error_rate": self.format_error_rate, "eval_mean_steps": self.mean_steps,
                "seconds_eval": round(self.seconds, 3)}

    def fork_line(self) -> str:
        return (f"the fork's Acc (pass_at_n.py): {self.fork_acc:.3f} ({self.fork_solved} of "
                f"{self.fork_tasks_with_result} tasks with a result); over all {self.tasks_total} tasks: "
                f"{self.fork_acc_over_all:.3f}")

    @property
    def fork_solved(self) -> int:
        return round(self.fork_acc_over_all * self.tasks_total)

    def table(self) -> str:
        """A plain-text table (one row per task, then the total); under a protocol that follows the
        OSWorld fork, its headline first."""
        head = f"{'task':<32} {'succ':>6} {'pass@k':>7} {'steps':>6} {'fmt_err':>8} {'env_err':>8}"
        rows = [f"protocol: {self.protocol}"]
        if self.desktop_env:
            rows[0] += f", desktop_env: {self.desktop_env.get('label')}"
        if self.lead_with_fork_acc:
            rows.append(self.fork_line())
            rows.append("ours (success over episodes with a result, pass@k over all tasks):")
        rows += [head, "-" * len(head)]
        for t in self.tasks:
            rows.append(f"{t.task:<32} {t.success_rate:>6.2f} {t.pass_at_k:>7.2f} {t.mean_steps:>6.1f} "
                        f"{t.format_error_rate:>8.2f} {t.env_errors:>8d}")
        rows.append("-" * len(head))
        rows.append(f"{'all':<32} {self.success_rate:>6.2f} {self.pass_at_k:>7.2f} {self.mean_steps:>6.1f} "
                    f"{self.format_error_rate:>8.2f} {self.env_errors:>8d}")
        if self.unfinished:
            rows.append(f"unfinished (no result, not in the rates; to run again): {self.unfinished}")
        for p in self.rerun:
            rows.append(f"pass {p['pass']}: {p['episodes']} episode(s) without a result run again, "
                        f"{p['still_without_result']} still without one")
        if not self.lead_with_fork_acc and any(t.task.startswith("osworld/") for t in self.tasks):
            rows.append(self.fork_line())
        return "\n".join(rows)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def summarize(trajs: Sequence[Trajectory], k: int | None = None) -> EvalResult:
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task[t.task].append(t)
    result = EvalResult()
    valid_all = []
    for task, ts in by_task.items():
        valid = [t for t in ts if t.ok]
        valid_all += valid
        n, c = len(valid), sum(t.success for t in valid)
        kk = min(k or n, n) if n else 0
        result.tasks.append(TaskResult(
            task=task, samples=n, successes=c, success_rate=c / n if n else 0.0,
            pass_at_k=pass_at_k(n, c, kk) if n else 0.0,
            mean_score=sum(t.task_score for t in valid) / n if n else 0.0,
            mean_steps=sum(t.num_steps for t in valid) / n if n else 0.0,
            format_error_rate=sum(not t.format_ok for t in valid) / n if n else 0.0,
            env_errors=sum(t.status == EpisodeStatus.ENV_ERROR for t in ts),
            unfinished=sum(t.status == EpisodeStatus.UNFINISHED for t in ts)))
    n = len(valid_all)
    result.episodes = len(trajs)
    result.success_rate = sum(t.success for t in valid_all) / n if n else 0.0
    result.pass_at_k = sum(t.successes > 0 for t in result.tasks) / len(result.tasks) if result.tasks else 0.0
    result.mean_steps = sum(t.num_steps for t in valid_all) / n if n else 0.0
    result.format_error_rate = sum(not t.format_ok for t in valid_all) / n if n else 0.0
    result.env_errors = sum(t.status == EpisodeStatus.ENV_ERROR for t in trajs)
    result.unfinished = sum(t.status == EpisodeStatus.UNFINISHED for t in trajs)
    result.setup_failed = sum(t.status == EpisodeStatus.SETUP_FAILED for t in trajs)
    result.checker_errors = sum(t.checker_error is not None for t in valid_all)
    # pass_at_n.py's figures: a task is solved when any of its samples with a result scores > 0.5
    # (result.txt is written for valid episodes only; the fork's Acc is over tasks with one)
    with_result = [t for t in result.tasks if t.samples]
    solved = sum(t.successes > 0 for t in with_result)
    result.tasks_total = len(result.tasks)
    result.fork_tasks_with_result = len(with_result)
    result.fork_acc = solved / len(with_result) if with_result else 0.0
    result.fork_acc_over_all = solved / len(result.tasks) if result.tasks else 0.0
    domains: dict[str, list[Trajectory]] = defaultdict(list)
    for t in valid_all:
        domains[domain_of(t.task)].append(t)
    result.per_domain = {d: sum(t.success for t in ts) / len(ts) for d, ts in domains.items()}
    return result


def unfinished_requests(trajs: Sequence[Trajectory], *, env_errors: bool = False) -> list[EpisodeRequest]:
    """The episodes to run again: those left unfinished (and with `env_errors` those lost to an
    infrastructure failure: the fork's runner writes no result for them either), with their own
    task, seed and sample (what the fork's get_unfinished hands its next pass)."""
    again = (EpisodeStatus.UNFINISHED, EpisodeStatus.ENV_ERROR) if env_errors else (EpisodeStatus.UNFINISHED,)
    return [EpisodeRequest(t.task, t.seed, t.sample) for t in trajs if t.status in again]


RERUN_ATTEMPTS = "unfinished_attempts"
"""Where an evaluation keeps the attempts that a later pass replaced: <eval>/unfinished_attempts/
pass_<n>/<domain>/<task>/<sample>/ (outside the results layout that readers scan)."""


def _rerun_without_result(engine: RolloutEngine, trajs: list[Trajectory], passes: int, *, temperature: float,
                          out_dir: str | Path | None, progress: bool, description: str) -> list[dict[str, Any]]:
    """Up to `passes` more passes over the episodes without a result, each replacing its attempt in
    `trajs` (in place). The replaced attempts are kept under RERUN_ATTEMPTS, not deleted as the
    fork's get_unfinished does. Returns one record per pass run."""
    import shutil

    from arpo_lib.run.records import safe_join

    record = []
    for n in range(1, passes + 1):
        again = unfinished_requests(trajs, env_errors=True)
        if not again:
            break
        keys = {(r.task, r.sample) for r in again}
        if out_dir is not None:
            for t in trajs:
                if (t.task, t.sample) in keys and t.directory and Path(t.directory).is_dir():
                    domain, _, name = t.task.rpartition("/")
                    keep = safe_join(out_dir, RERUN_ATTEMPTS, f"pass_{n - 1}", domain or "default", name, str(t.sample))
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(keep, ignore_errors=True)
                    shutil.move(t.directory, keep)
        fresh = {(t.task, t.sample): t for t in engine.run(again, temperature=temperature, out_dir=out_dir,
                                                             progress=progress, description=f"{description} pass {n}")}
        trajs[:] = [fresh.get((t.task, t.sample), t) for t in trajs]
        record.append({"pass": n, "episodes": len(again),
                       "still_without_result": len(unfinished_requests(list(fresh.values()), env_errors=True))})
    return record


class Spread(Protocol):
    """The processes an evaluation is spread over (a training backend: `training.backend`): each
    plays `share(requests)` on its own environments, and every one gets every process's list back
    (`gather_lists`). Rank 0 (`is_main`) writes the result."""

    is_main: bool

    def share(self, items: Sequence[Any]) -> list[Any]: ...

    def gather_lists(self, mine: list[Any]) -> list[list[Any]]: ...


def evaluate(
    engine: RolloutEngine,
    tasks: Sequence[str],
    *,
    samples_per_task: int = 4,
    temperature: float = 0.5,
    seed: int = 1000,
    out_dir: str | Path | None = None,
    progress: bool = True,
    description: str = "eval",
    protocol: str = "run",
    max_new_tokens: int | None = None,
    rerun_passes: int | None = None,
    desktop_env: dict[str, Any] | None = None,
    spread: Spread | None = None,
) -> EvalResult:
    """Run k episodes per task with seeds fixed by (seed, task, sample); same seeds every call.
    Then up to `rerun_passes` (None: the protocol's) more passes over the episodes left without a
    result, as the OSWorld fork's runner runs them again.

    `spread`: every process of a distributed run calls this together; each plays its share of the
    episodes (and reruns its own), then every process summarizes all of them (the same result
    everywhere); rank 0 writes it. An episode's seed is its (seed, task, sample): who plays it
    does not change it. Each process writes its episodes' directories under `out_dir` (one
    directory on a shared file system; on nodes without one, each node holds its ranks' episodes)."""
    requests = episode_requests(tasks, samples_per_task, seed)
    t0 = time.monotonic()
    steps_before = engine.env_steps
    torch.manual_seed(stable_seed(seed, "eval-sampling"))
    mine = spread.share(requests) if spread is not None else requests
    progress = progress and (spread is None or spread.is_main)
    trajs = engine.run(mine, temperature=temperature, out_dir=out_dir, progress=progress, description=description)
    p = PROTOCOLS[protocol]
    passes = p.rerun_passes if rerun_passes is None else rerun_passes
    rerun = _rerun_without_result(engine, trajs, passes, temperature=temperature, out_dir=out_dir,
                                  progress=progress, description=description) if passes > 0 else []
    env_steps = engine.env_steps - steps_before
    by_rank = None
    if spread is not None:
        trajs, rerun, env_steps, by_rank = _gathered(spread, requests, trajs, rerun, env_steps)
    result = summarize(trajs, samples_per_task)
    result.rerun = rerun
    result.episodes_by_rank = by_rank
    result.desktop_env = desktop_env
    result.lead_with_fork_acc = p.report_fork_acc_first
    result.protocol = protocol
    result.max_new_tokens = max_new_tokens
    result.seconds = time.monotonic() - t0
    result.env_steps = env_steps
    if out_dir is not None and (spread is None or spread.is_main):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / layout.EVAL_RESULTS).write_text(json.dumps(result.to_dict(), indent=1))
    return result


def _gathered(spread: Spread, requests: Sequence[EpisodeRequest], mine: list[Trajectory],
              rerun: list[dict[str, Any]], env_steps: int
              ) -> tuple[list[Trajectory], list[dict[str, Any]], int, list[int]]:
    """Every process's episodes (without pixels: what a summary reads), in request order, their
    reruns pass by pass and environment steps summed, and the episodes each process played."""
    from arpo_lib.rollout.store import without_pixels

    parts = [part for (part,) in spread.gather_lists([([without_pixels(t) for t in mine], rerun, env_steps)])]
    order = {(r.task, r.sample): i for i, r in enumerate(requests)}
    trajs = sorted((t for part in parts for t in part[0]), key=lambda t: order[(t.task, t.sample)])
    passes: dict[int, dict[str, Any]] = {}
    for _, records, _ in parts:
        for rec in records:
            into = passes.setdefault(rec["pass"], {"pass": rec["pass"], "episodes": 0, "still_without_result": 0})
            into["episodes"] += rec["episodes"]
            into["still_without_result"] += rec["still_without_result"]
    by_rank = [len(part[0]) + sum(rec["episodes"] for rec in part[1]) for part in parts]
    return trajs, [passes[n] for n in sorted(passes)], sum(part[2] for part in parts), by_rank


def evaluate_run(engine: RolloutEngine, cfg: RunConfig, out_dir: str | Path | None, *,
                 tasks: Sequence[str] | None = None, description: str = "eval",
                 protocol: str | None = None, spread: Spread | None = None) -> EvalResult:
    """A run's evaluation (`eval.samples_per_task`, `eval.seed`, the temperature of the protocol
    or `eval.temperature`) on `tasks`, else `eval.tasks`, else the training tasks. `protocol`
    (default eval.protocol) must be the one the engine was built for (`build.engine`)."""
    from arpo_lib.envs.osworld.build_info import desktop_env_of

    p = PROTOCOLS[protocol or cfg.eval.protocol]
    temperature = cfg.eval.temperature if p.temperature is None else p.temperature
    return evaluate(engine, list(tasks or cfg.eval.tasks or cfg.env.tasks), samples_per_task=cfg.eval.samples_per_task,
                    temperature=temperature, seed=cfg.eval.seed, out_dir=out_dir, progress=cfg.logging.progress,
                    description=description, protocol=p.name,
                    max_new_tokens=cfg.eval.max_new_tokens if p.max_new_tokens is not None else None,
                    rerun_passes=cfg.eval.rerun_passes, desktop_env=desktop_env_of(cfg), spread=spread)
