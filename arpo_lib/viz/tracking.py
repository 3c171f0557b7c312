"""What a run shows in wandb beyond numbers: a table of sampled episodes per training step (the
last screenshot with the action drawn, the final thought and action, success, replayed or not)
and a per-task table per evaluation. Read from the run directory, like the viewers
(`viz.draw`): the trainer passes `TrackerMedia` to `run.tracking.Tracker`, which turns the rows
into wandb tables. Nothing here imports wandb.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from arpo_lib.rollout.store import TrajectoryFormatError
from arpo_lib.run import layout
from arpo_lib.run.layout import RunDir
from arpo_lib.viz.draw import load_frames, resolve_member_dir, thumbnail

EPISODE_COLUMNS = ("task", "success", "task_score", "reward", "advantage", "steps", "replayed", "thought", "action",
                   "screenshot")
EVAL_COLUMNS = ("task", "samples", "successes", "success_rate", "pass_at_k", "mean_steps", "format_error_rate",
                "env_errors")


def sample_members(groups: list[dict[str, Any]], limit: int) -> list[tuple[str, dict[str, Any]]]:
    """Up to `limit` (task, member) pairs of a step's groups.json: every replayed member first
    (what ARPO adds), then one member of each group in turn (member 0 of every group, then member
    1, ...), so the table spans tasks before it repeats one. Deterministic."""
    chosen: list[tuple[str, dict[str, Any]]] = []
    seen: set[int] = set()

    def take(task: str, member: dict[str, Any]) -> None:
        if len(chosen) < limit and id(member) not in seen:
            seen.add(id(member))
            chosen.append((task, member))

    for g in groups:
        for m in g.get("members", []):
            if m.get("replayed"):
                take(str(g.get("task")), m)
    depth = max((len(g.get("members", [])) for g in groups), default=0)
    for i in range(depth):
        for g in groups:
            members = g.get("members", [])
            if i < len(members):
                take(str(g.get("task")), members[i])
    return chosen


def episode_rows(run_dir: str | Path, step_index: int, limit: int, image_width: int = 640) -> list[dict[str, Any]]:
    """Rows for `limit` episodes of rollout batch `step_index` (groups.json's step: the metrics
    line's `step` minus 1): the last action drawn on the screen it was taken on (a PIL image no
    wider than `image_width`), its thought and action, the member's numbers."""
    if limit <= 0:
        return []
    run = RunDir(Path(run_dir))
    groups = layout.read_groups(run.groups(step_index))
    rows = []
    for task, member in sample_members(groups, limit):
        directory = resolve_member_dir(member.get("dir") or "", run_dir)
        try:
            frames = load_frames(directory, replayed=bool(member.get("replayed")))
        except (FileNotFoundError, TrajectoryFormatError) as exc:
            frames, problem = [], f"trajectory unreadable: {exc}"
        else:
            problem = ""
        acted = [f for f in frames if not f.final]
        last = acted[-1] if acted else (frames[-1] if frames else None)
        score = float(member.get("task_score") or 0.0)
        rows.append({
            "task": task, "success": score > 0, "task_score": score, "reward": float(member.get("reward") or 0.0),
            "advantage": float(member.get("advantage") or 0.0), "steps": len(acted),
            "replayed": bool(member.get("replayed")), "thought": last.thought if last else "",
            "action": last.action_text if last else problem,
            "screenshot": thumbnail(last.image, image_width) if last else None,
        })
    return rows


def eval_rows(run_dir: str | Path, label: str) -> list[dict[str, Any]]:
    """Per-task rows of evaluation `label` (<run>/eval/<label>/results.json); [] when absent."""
    path = RunDir(Path(run_dir)).eval_root / label / "results.json"
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    return [{c: t.get(c) for c in EVAL_COLUMNS} for t in result.get("tasks", [])]


class TrackerMedia:
    """The tables of one training step, for `Tracker(media=...)`: `media(metrics)` -> {table name:
    rows}. `episodes`: how many episodes per step (logging.wandb_episodes; 0: none); evaluation
    tables come with the steps that evaluated."""

    def __init__(self, run_dir: str | Path, episodes: int, image_width: int = 640):
        self.run_dir, self.episodes, self.image_width = Path(run_dir), episodes, image_width

    def __call__(self, metrics: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        step = int(metrics["step"])
        tables: dict[str, list[dict[str, Any]]] = {}
        rows = episode_rows(self.run_dir, step - 1, self.episodes, self.image_width)
        if rows:
            tables["episodes"] = rows
        if any(k.startswith("eval_") for k in metrics):
            rows = eval_rows(self.run_dir, layout.step_name(step))
            if rows:
                tables["eval_tasks"] = rows
        return tables
