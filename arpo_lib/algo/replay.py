"""ARPO's contribution: a per-task replay buffer of successful trajectories.

The problem. GRPO learns from differences within a group of G rollouts of one task. When all G
fail, every advantage is 0 and the group teaches nothing; on hard GUI tasks early in training
this is most groups.

The fix (ARPO, Lu et al. 2025). Keep, per task, the last few successful trajectories. When a
fresh group comes back "all failed" (task-score std < 0.05 and mean < 0.2), replace ONE of its
trajectories with a stored success of the same task, drawn uniformly. The group now has a
success, so it gets a non-zero advantage signal. Groups that are all successes or mixed are left
alone, and nothing happens for a task that has never succeeded. In the trainer, per group:

    result = buffer.maybe_inject(task_id, group, scores)    # 1. replace (result.replaced: which)
    for item, score in zip(group, scores):                  # 2. then store the FRESH rollouts
        buffer.add(task_id, item, score)

The order is the original's: it injects, then updates the buffer with the pre-replacement batch.

What we kept from the original (dvlab-research/ARPO, verl/trainer/replay_buffer.py and
`apply_replay` in verl/trainer/ray_trainer.py):
- a trajectory is stored when its TASK score is strictly > 0.1 (format reward not counted);
  FIFO of 8 per task;
- "all failed" uses the population std (`np.std`, ddof=0), see `is_all_failed`;
- the replaced trajectory is the FIRST of the group (the original builds
  `[replayed] + group[1:]`), and the replayed one brings its own stored score.

Where we depart:
- `enabled=False` really disables replay (never stores, never injects: plain GRPO). The
  original's `enable_replay` flag is never read.
- Draws come from the buffer's own `random.Random(seed)`, not the global `random` module, and
  its state is checkpointed with the contents (`save`/`load`): a resumed run makes the same draws.
  The original buffer lives only in memory and is lost on restart.
- Items are small JSON-serialisable references (e.g. a dict pointing at a trajectory directory
  on disk), never pixel tensors; the original keeps float32 screenshots (~0.75 GB per
  trajectory) in the driver.
- Items are deep-copied on the way in and out, so the trainer cannot corrupt the buffer by
  editing what it got back.
The original then recomputes "old" log-probs of replayed trajectories with the current policy
(treating them as on-policy); that choice belongs to the trainer, not to this file.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import tempfile
from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from arpo_lib.algo.advantages import is_all_failed
from arpo_lib.run.records import fsync_dir

T = TypeVar("T")


@dataclass(frozen=True)
class Injection(Generic[T]):
    """What `maybe_inject` did to one group."""

    group: list[T]
    """(G,) the group to train on: the fresh one, or with member `replaced` swapped for a stored success."""
    scores: list[float]
    """(G,) their task scores."""
    all_failed: bool
    """The fresh group was all-failed (`is_all_failed`), injected or not."""
    replaced: int | None
    """Index of the member replaced by a stored success; None when nothing was injected."""

    @property
    def injected(self) -> bool:
        return self.replaced is not None

def replay_item(directory: str | None, task_score: float, reward: float) -> dict[str, Any]:
    """What the buffer keeps of a trajectory: a reference to its stored directory (never pixels),
    its task score and its reward. The item's schema lives here only: read it with `item_directory`."""
    return {"dir": directory, "score": task_score, "reward": reward}


def item_directory(item: dict[str, Any]) -> str:
    """Where the trajectory an item (`replay_item`) refers to is stored."""
    return str(item["dir"])


_FORMAT = "arpo-replay-buffer"
_VERSION = 1


class ReplayBuffer(Generic[T]):
    """Per-task FIFO of successful trajectories, injected into all-failed groups.

    Args:
        capacity_per_task: successes kept per task; the oldest is evicted first (8 in ARPO).
        success_threshold: a trajectory is stored when its task score is strictly above this.
        enabled: False turns ARPO into plain GRPO: `add` stores nothing, `maybe_inject` never injects.
        seed: seed of the buffer's own random generator (the uniform draw of a stored success).
        std_threshold, mean_threshold: the "all failed" test, see `is_all_failed`.
    """

    def __init__(
        self,
        capacity_per_task: int = 8,
        success_threshold: float = 0.1,
        enabled: bool = True,
        seed: int = 0,
        std_threshold: float = 0.05,
        mean_threshold: float = 0.2,
    ) -> None:
        if capacity_per_task < 1:
            raise ValueError(f"capacity_per_task must be >= 1, got {capacity_per_task}")
        self.capacity_per_task = int(capacity_per_task)
        self.success_threshold = float(success_threshold)
        self.enabled = bool(enabled)
        self.seed = int(seed)
        self.std_threshold = float(std_threshold)
        self.mean_threshold = float(mean_threshold)
        self._rng = random.Random(self.seed)
        self._tasks: dict[str, deque[tuple[T, float]]] = {}
        self.total_added = 0
        self.total_injections = 0

    # -- the algorithm ---------------------------------------------------------------------------

    def add(self, task_id: str, item: T, score: float) -> bool:
        """Store `item` (a trajectory of task `task_id` with TASK score `score`) if it succeeded.

        Returns True when stored. Items must be JSON-serialisable (checked here, not at the next
        checkpoint, so the mistake shows where it is made).
        """
        if not isinstance(task_id, str):
            raise TypeError(f"task_id must be a str (it becomes a JSON key), got {type(task_id).__name__}")
        if not math.isfinite(score):
            raise ValueError(f"score must be finite, got {score!r}")
        if not self.enabled or score <= self.success_threshold:
            return False
        try:
            json.dumps(item)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"replay items must be JSON-serialisable (store references, not tensors): {e}"
            ) from e
        stored = self._tasks.setdefault(task_id, deque(maxlen=self.capacity_per_task))
        stored.append((copy.deepcopy(item), float(score)))  # maxlen evicts the oldest
        self.total_added += 1
        return True

    def maybe_inject(self, task_id: str, group: Sequence[T], scores: Sequence[float]) -> Injection[T]:
        """Replace the first trajectory of an all-failed group with a stored success.

        Args:
            task_id: the task all trajectories of the group belong to.
            group: (G,) the fresh trajectories.
            scores: (G,) their TASK scores.

        Returns:
            An `Injection`: new lists (the inputs are never mutated), whether the group is
            all-failed, and the index of the replaced member (0, as the original) or None. When
            injected, that element is a uniformly drawn stored success with its stored score.
        """
        if len(group) != len(scores):
            raise ValueError(f"group and scores differ in length: {len(group)} != {len(scores)}")
        if len(group) == 0:
            raise ValueError("group must not be empty")
        new_group, new_scores = list(group), [float(s) for s in scores]
        all_failed = is_all_failed(new_scores, self.std_threshold, self.mean_threshold)
        stored = self._tasks.get(task_id)
        if not self.enabled or not stored or not all_failed:
            return Injection(new_group, new_scores, all_failed, None)
        item, score = stored[self._rng.randrange(len(stored))]
        new_group[0], new_scores[0] = copy.deepcopy(item), score
        self.total_injections += 1
        return Injection(new_group, new_scores, all_failed, 0)

    # -- inspection ------------------------------------------------------------------------------

    def successes(self, task_id: str) -> list[T]:
        """Copies of the stored successes of a task, oldest first ([] if none)."""
        return [copy.deepcopy(item) for item, _ in self._tasks.get(task_id, ())]

    def stats(self) -> dict[str, int]:
        """Counts for logging."""
        return {
            "tasks_with_successes": sum(1 for d in self._tasks.values() if d),
            "stored": len(self),
            "added": self.total_added,
            "injections": self.total_injections,
        }

    def __len__(self) -> int:
        return sum(len(d) for d in self._tasks.values())

    def __contains__(self, task_id: object) -> bool:
        return isinstance(task_id, str) and bool(self._tasks.get(task_id))

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(enabled={self.enabled}, capacity_per_task={self.capacity_per_task}, "
            f"{self.stats()})"
        )

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: config, contents, generator state, counters (JSON-ready)."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "config": {
                "capacity_per_task": self.capacity_per_task,
                "success_threshold": self.success_threshold,
                "enabled": self.enabled,
                "seed": self.seed,
                "std_threshold": self.std_threshold,
                "mean_threshold": self.mean_threshold,
            },
            "tasks": {
                task_id: [{"item": copy.deepcopy(item), "score": score} for item, score in stored]
                for task_id, stored in self._tasks.items()
            },
            "rng_state": [version, list(internal), gauss_next],
            "total_added": self.total_added,
            "total_injections": self.total_injections,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ReplayBuffer[Any]:
        """Inverse of `state_dict`; raises ValueError naming what is wrong."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a replay buffer state (expected format {_FORMAT!r})")
        if state.get("version") != _VERSION:
            raise ValueError(
                f"unsupported replay buffer version {state.get('version')!r} (expected {_VERSION})"
            )
        try:
            buffer = cls(**state["config"])
            for task_id, entries in state["tasks"].items():
                buffer._tasks[task_id] = deque(
                    ((copy.deepcopy(e["item"]), float(e["score"])) for e in entries),
                    maxlen=buffer.capacity_per_task,
                )
            version, internal, gauss_next = state["rng_state"]
            buffer._rng.setstate((version, tuple(internal), gauss_next))
            buffer.total_added = int(state["total_added"])
            buffer.total_injections = int(state["total_injections"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed replay buffer state: {type(e).__name__}: {e}") from e
        return buffer

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer as JSON, atomically: a crash leaves either the old file or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ReplayBuffer[Any]:
        """Read a buffer written by `save`; a truncated or foreign file raises ValueError."""
        try:
            text = Path(path).read_text(encoding="utf-8")
            state = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"replay buffer file {str(path)!r} is corrupt: {e}") from e
        try:
            return cls.from_state_dict(state)
        except ValueError as e:
            raise ValueError(f"replay buffer file {str(path)!r}: {e}") from e
