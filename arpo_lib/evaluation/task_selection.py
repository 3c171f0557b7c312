"""Task selection (ARPO's filtering): keep the tasks the base policy solves at least once in k tries.

ARPO rolls the base agent out 16 times per OSWorld task and trains only on tasks with at least one
success (128 of 369): a task that never succeeds gives GRPO no signal, and gives the replay buffer
nothing to store. `select_tasks` runs that protocol on any task family:

    <out>/episodes.jsonl   one line per finished episode (appended and fsynced: the resume log)
    <out>/selection.json   per-task counts, the kept list, the protocol (k, seed, temperature)
    <out>/selection.md     a per-domain table and the per-task table
    <out>/kept_tasks.yaml  `env: {tasks: [...]}`, usable as a config file or copied into one

Departures from the original: an episode that failed for infrastructure reasons (a browser or VM
died) is re-run instead of being counted as a policy failure, and the run resumes after a crash
from `episodes.jsonl` without repeating finished episodes.
"""
from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from arpo_lib.envs import domain_of
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.run import layout
from arpo_lib.run.records import append_jsonl, atomic_write_text, read_jsonl
from arpo_lib.run.seeding import stable_seed
from arpo_lib.types import EpisodeRequest, Trajectory


@dataclass
class TaskCount:
    task: str
    domain: str
    samples: int
    """Valid (non-infrastructure-failure) episodes."""
    successes: int
    env_errors: int
    """Infrastructure failures, re-run and not counted in `samples`."""
    kept: bool


@dataclass
class SelectionResult:
    k: int
    min_successes: int
    seed: int
    temperature: float
    tasks: list[TaskCount] = field(default_factory=list)
    seconds: float = 0.0
    max_successes: int | None = None
    """Kept only up to this many successes (None: ARPO's rule, no upper bound)."""

    @property
    def kept(self) -> list[str]:
        return [t.task for t in self.tasks if t.kept]

    @property
    def incomplete(self) -> list[str]:
        """Tasks with fewer than k valid episodes (infrastructure failures outlasted the retries)."""
        return [t.task for t in self.tasks if t.samples < self.k]

    def per_domain(self) -> dict[str, dict[str, Any]]:
        """domain -> {tasks, kept, kept_share, success_rate} over valid episodes."""
        rows: dict[str, dict[str, Any]] = {}
        by_domain: dict[str, list[TaskCount]] = defaultdict(list)
        for t in self.tasks:
            by_domain[t.domain].append(t)
        for domain in sorted(by_domain):
            ts = by_domain[domain]
            samples = sum(t.samples for t in ts)
            rows[domain] = {"tasks": len(ts), "kept": sum(t.kept for t in ts),
                            "kept_share": sum(t.kept for t in ts) / len(ts),
                            "success_rate": sum(t.successes for t in ts) / samples if samples else 0.0}
        return rows

    def table(self) -> str:
        """Markdown: the per-domain summary, then one row per task."""
        bound = "" if self.max_successes is None else f" and <= {self.max_successes}"
        lines = [f"Task selection: k={self.k} rollouts per task, kept when successes >= {self.min_successes}{bound} "
                 f"(seed {self.seed}, temperature {self.temperature})", "",
                 "| domain | tasks | kept | kept share | success rate |", "|---|---:|---:|---:|---:|"]
        for domain, row in self.per_domain().items():
            lines.append(f"| {domain} | {row['tasks']} | {row['kept']} | {row['kept_share']:.2f} | {row['success_rate']:.2f} |")
        total = len(self.tasks)
        lines.append(f"| **all** | {total} | {len(self.kept)} | {len(self.kept) / total if total else 0:.2f} | "
                     f"{self.success_rate:.2f} |")
        lines += ["", "| task | successes / valid | infrastructure failures | kept |", "|---|---:|---:|:---:|"]
        for t in self.tasks:
            lines.append(f"| {t.task} | {t.successes} / {t.samples} | {t.env_errors} | {'yes' if t.kept else 'no'} |")
        return "\n".join(lines)

    @property
    def success_rate(self) -> float:
        samples = sum(t.samples for t in self.tasks)
        return sum(t.successes for t in self.tasks) / samples if samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept"] = self.kept
        d["incomplete"] = self.incomplete
        d["per_domain"] = self.per_domain()
        return d


def _episode_record(traj: Trajectory, attempt: int) -> dict[str, Any]:
    return {"task": traj.task, "sample": traj.sample, "seed": traj.seed, "attempt": attempt,
            "status": traj.status.value, "success": traj.success, "task_score": traj.task_score,
            "num_steps": traj.num_steps, "error": (traj.error or "")[:500] or None}


def select_tasks(
    engine: RolloutEngine,
    tasks: Sequence[str],
    out_dir: str | Path,
    *,
    k: int = 16,
    min_successes: int = 1,
    seed: int = 0,
    temperature: float = 1.0,
    max_env_retries: int = 2,
    tasks_per_chunk: int | None = None,
    save_trajectories: bool = False,
    max_successes: int | None = None,
    progress: bool = True,
) -> SelectionResult:
    """Roll the policy out k times per task and keep tasks with >= `min_successes` successes.

    Resumable: episodes already in `<out_dir>/episodes.jsonl` (for the same k, seed and
    temperature) are not run again. Work goes in chunks of `tasks_per_chunk` tasks (default:
    enough to fill the pool twice), so a crash loses at most one chunk. Infrastructure failures
    are re-run up to `max_env_retries` times with fresh seeds. `max_successes`: also drop tasks
    solved more often than this (not ARPO's rule: a study of replay wants tasks solved rarely).
    """
    if k < 1 or min_successes < 1:
        raise ValueError(f"k ({k}) and min_successes ({min_successes}) must be at least 1")
    if min_successes > k:
        raise ValueError(f"min_successes ({min_successes}) cannot exceed k ({k})")
    if max_successes is not None and max_successes < min_successes:
        raise ValueError(f"max_successes ({max_successes}) cannot be below min_successes ({min_successes})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    protocol = {"k": k, "seed": seed, "temperature": temperature}
    _check_protocol(out / layout.SELECTION_PROTOCOL, protocol)
    log = out / layout.SELECTION_LOG
    done: dict[tuple[str, int], dict[str, Any]] = {}
    attempts: dict[tuple[str, int], int] = defaultdict(int)
    for rec in read_jsonl(log):
        key = (rec["task"], rec["sample"])
        attempts[key] = max(attempts[key], rec["attempt"] + 1)
        if rec["status"] == "ok":
            done[key] = rec
    t0 = time.monotonic()
    chunk = tasks_per_chunk or max(1, math.ceil(2 * len(engine.pool) / k))
    task_list = list(dict.fromkeys(tasks))
    from tqdm.auto import tqdm

    wanted = set(task_list)
    bar = tqdm(total=len(task_list) * k, initial=sum(t in wanted and i < k for t, i in done),
               desc="task selection", disable=not progress)
    try:
        for start in range(0, len(task_list), chunk):
            part = task_list[start:start + chunk]
            for _ in range(max_env_retries + 1):
                todo = [(t, i) for t in part for i in range(k)
                        if (t, i) not in done and attempts[(t, i)] <= max_env_retries]
                if not todo:
                    break
                requests = [EpisodeRequest(t, stable_seed(seed, "select", t, i, attempts[(t, i)]), i) for t, i in todo]

                def record(traj: Trajectory) -> None:
                    key = (traj.task, traj.sample)
                    rec = _episode_record(traj, attempts[key])
                    append_jsonl(log, rec)
                    attempts[key] += 1
                    if traj.ok:
                        done[key] = rec
                        bar.update(1)

                engine.run(requests, temperature=temperature, progress=False, description="select",
                           out_dir=out / "trajectories" if save_trajectories else None, on_finish=record)
    finally:
        bar.close()
    result = _count(task_list, read_jsonl(log), k=k, min_successes=min_successes, seed=seed, temperature=temperature,
                    max_successes=max_successes)
    result.seconds = time.monotonic() - t0
    write_selection(result, out)
    return result


def _check_protocol(path: Path, protocol: dict[str, Any]) -> None:
    """A resumed selection must use the protocol its log was written with."""
    if path.is_file():
        old = json.loads(path.read_text())
        if old != protocol:
            raise ValueError(f"{path.parent} holds a selection with {old}, not {protocol}: "
                             "choose another output directory or delete it")
    else:
        atomic_write_text(path, json.dumps(protocol))


def _count(tasks: Sequence[str], records: list[dict[str, Any]], *, k: int, min_successes: int, seed: int,
           temperature: float, max_successes: int | None = None) -> SelectionResult:
    ok: dict[tuple[str, int], dict[str, Any]] = {}
    errors: dict[str, int] = defaultdict(int)
    for rec in records:
        if rec["status"] == "ok":
            ok.setdefault((rec["task"], rec["sample"]), rec)
        else:
            errors[rec["task"]] += 1
    result = SelectionResult(k=k, min_successes=min_successes, seed=seed, temperature=temperature,
                             max_successes=max_successes)
    for task in tasks:
        valid = [r for (t, _), r in ok.items() if t == task]
        successes = sum(bool(r["success"]) for r in valid)
        result.tasks.append(TaskCount(task=task, domain=domain_of(task), samples=len(valid), successes=successes,
                                      env_errors=errors[task], kept=successes >= min_successes and (
                                          max_successes is None or successes <= max_successes)))
    return result


def write_selection(result: SelectionResult, out: Path) -> None:
    atomic_write_text(out / layout.SELECTION_RESULT, json.dumps(result.to_dict(), indent=1))
    atomic_write_text(out / layout.SELECTION_TABLE, result.table() + "\n")
    atomic_write_text(out / layout.KEPT_TASKS, yaml.safe_dump({"env": {"tasks": result.kept}}, sort_keys=False))


def load_selection(path: str | Path) -> list[str]:
    """The kept task list of a selection (its directory, selection.json or kept_tasks.yaml)."""
    path = Path(path)
    if path.is_dir():
        path = path / layout.SELECTION_RESULT
    if not path.is_file():
        raise FileNotFoundError(f"no task selection at {path}: run `./workbench select-tasks` first")
    if path.suffix in (".yaml", ".yml"):
        return list(yaml.safe_load(path.read_text())["env"]["tasks"])
    return list(json.loads(path.read_text())["kept"])
