"""Experiment tracking: wandb when asked (`logging.wandb: offline|online`), a no-op otherwise.

Per training step: every number of the metrics line (per-task success as
`success_by_task/<task>`), and, given `media` (`viz.tracking.TrackerMedia`, which the build
passes), a table of sampled episodes (`logging.wandb_episodes` per step: task, success, steps,
the final thought and action, the last screenshot with the action drawn, replayed or not) and,
at steps that evaluated, a per-task table. The run's config goes in at the start. Rank 0 only
(the trainer creates the tracker there). wandb is imported only when enabled, so the library
works without it installed.
"""
from __future__ import annotations

from typing import Any, Callable

Media = Callable[[dict[str, Any]], dict[str, list[dict[str, Any]]]]
"""metrics line -> {table name: rows (dicts; PIL images become wandb images)}."""


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line; `success_by_task: {task: [successes, episodes]}` as one
    rate per task."""
    out: dict[str, float] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    for task, counts in (metrics.get("success_by_task") or {}).items():
        if isinstance(counts, (list, tuple)) and len(counts) == 2 and counts[1]:
            out[f"success_by_task/{task}"] = counts[0] / counts[1]
    return out


class Tracker:
    """Logs metrics (and `media`'s tables) to wandb in `offline`/`online` mode; does nothing
    when `disabled`."""

    def __init__(self, cfg: Any, media: Media | None = None):
        self.run = None
        self.media = media
        mode = cfg.logging.wandb
        if mode == "disabled":
            return
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("logging.wandb is enabled but wandb is not installed: "
                              "pip install -e '.[tracking]' or set logging.wandb=disabled") from exc
        self._wandb = wandb
        self.run = wandb.init(project=cfg.logging.wandb_project, name=cfg.name, mode=mode,
                              dir=str(cfg.run_dir), config=cfg.to_dict(), resume="allow")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        payload: dict[str, Any] = scalars(metrics)
        if self.media is not None:
            for name, rows in self.media(metrics).items():
                payload[name] = self._table(rows)
        self.run.log(payload, step=step)

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        from PIL import Image

        columns = list(rows[0]) if rows else []
        data = [[self._wandb.Image(v) if isinstance(v, Image.Image) else v for v in row.values()] for row in rows]
        return self._wandb.Table(columns=columns, data=data)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
