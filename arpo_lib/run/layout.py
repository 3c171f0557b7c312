"""Every file and directory name a run writes, in one place, and the `groups.json` schema.

    <out_dir>/<name>/                   a run directory (`RunDir`)
        config.yaml                     the config it was started (or last resumed) with
        config.until_step_000012.yaml   the config before a resume at step 12 that changed it
        metrics.jsonl                   one line per training step (the source of truth)
        warm_start.jsonl                the supervised warm start's record
        demos/                          scripted demonstrations (trajectory directories)
        rollouts/step_000003/           the trajectories of training step 3, and
            groups.json                 what each group trained on (`group_records`)
        eval/<label>/results.json       evaluations (trajectories beside results.json)
        selection/                      ARPO's task selection
        checkpoints/step_000004/        `CheckpointFiles`
        server.json, server.log         a model server the run started
        summary.json                    the smoke run's summary

    <trajectory directory>/             OSWorld's result layout plus our token data (the records'
                                        schema, writer and reader: `arpo_lib.rollout.store`)
        step_0.png ... step_N.png       the screenshots the model saw
        traj.jsonl                      one line per step
        result.txt                      the task score (absent: an unfinished episode)
        tokens.pt                       token ids, loss mask, behaviour log-probs per segment
        meta.json                       task, seed, scores, status (written last: marks completeness)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- a run directory ------------------------------------------------------------------------------
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
WARM_START_LOG = "warm_start.jsonl"
DEMOS = "demos"
ROLLOUTS = "rollouts"
GROUPS = "groups.json"
EVAL = "eval"
SELECTION = "selection"
CHECKPOINTS = "checkpoints"
SERVER_WEIGHTS = "server_weights"
SERVER_INFO = "server.json"
SERVER_LOG = "server.log"
SUMMARY = "summary.json"

# -- an evaluation directory ----------------------------------------------------------------------
EVAL_RESULTS = "results.json"

# -- a task-selection directory -------------------------------------------------------------------
SELECTION_LOG = "episodes.jsonl"
SELECTION_PROTOCOL = "protocol.json"
SELECTION_RESULT = "selection.json"
SELECTION_TABLE = "selection.md"
KEPT_TASKS = "kept_tasks.yaml"

# -- a trajectory directory -----------------------------------------------------------------------
STEPS = "traj.jsonl"
RESULT = "result.txt"
TOKENS = "tokens.pt"
META = "meta.json"
SCREENSHOT = re.compile(r"step_(\d+)\.png$")


def screenshot_name(step: int) -> str:
    """`step_3.png`: the screenshot the model saw before action 3 (step 0 = after reset)."""
    return f"step_{step}.png"


# -- a checkpoint directory -----------------------------------------------------------------------
MODEL = "model"
OPTIMIZER = "optimizer.pt"
OPTIMIZER_SHARDS = "optimizer_shards"
REPLAY = "replay.json"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
COMPLETE = ".complete"


def step_name(step: int) -> str:
    """`step_000012`: the directory name of a training step's rollouts or checkpoint."""
    return f"step_{step:06d}"


STEP_DIR = re.compile(r"step_(\d{6})$")


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    def config_until(self, step: int) -> Path:
        """Where a resume at `step` with a changed config keeps the config the run had until then."""
        return self.root / f"config.until_{step_name(step)}.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def warm_start_log(self) -> Path:
        return self.root / WARM_START_LOG

    @property
    def demos(self) -> Path:
        return self.root / DEMOS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def eval_root(self) -> Path:
        return self.root / EVAL

    @property
    def selection(self) -> Path:
        return self.root / SELECTION

    @property
    def server_weights(self) -> Path:
        return self.root / SERVER_WEIGHTS

    @property
    def server_info(self) -> Path:
        return self.root / SERVER_INFO

    @property
    def server_log(self) -> Path:
        return self.root / SERVER_LOG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    def rollouts(self, step: int) -> Path:
        """The trajectories of training step `step` (0-based, as written during that step)."""
        return self.root / ROLLOUTS / step_name(step)

    def groups(self, step: int) -> Path:
        return self.rollouts(step) / GROUPS

    def all_groups(self) -> list[tuple[int, Path]]:
        """(step, groups.json) of every recorded training step, in order."""
        found = []
        for path in (self.root / ROLLOUTS).glob(f"step_*/{GROUPS}"):
            m = STEP_DIR.fullmatch(path.parent.name)
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found)


# -- groups.json: what each group of a training step trained on ----------------------------------
MEMBER_KEYS = ("dir", "task_score", "reward", "advantage", "replayed", "format_ok", "num_steps")
"""Every member record has these keys (`dir`: the trajectory directory)."""


def group_record(task: str, *, all_failed: bool, injected: bool, members: list[dict[str, Any]]) -> dict[str, Any]:
    """One group's entry in groups.json; `members` hold `MEMBER_KEYS`."""
    for m in members:
        missing = [k for k in MEMBER_KEYS if k not in m]
        if missing:
            raise ValueError(f"group member record lacks {missing}")
    return {"task": task, "all_failed": bool(all_failed), "injected": bool(injected), "members": members}


def write_groups(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1))


def read_groups(path: Path) -> list[dict[str, Any]]:
    """The group records of one step; [] for a missing or unreadable file (a step still running)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return [g for g in data if isinstance(g, dict)] if isinstance(data, list) else []
