"""Experiment tracking: wandb when asked (`logging.wandb: offline|online`), a no-op otherwise.

wandb is imported only when enabled, so the library works without it installed.
"""
from __future__ import annotations

from typing import Any


class Tracker:
    """Logs metrics to wandb in `offline`/`online` mode; does nothing when `disabled`."""

    def __init__(self, cfg: Any):
        self.run = None
        mode = cfg.logging.wandb
        if mode == "disabled":
            return
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("logging.wandb is enabled but wandb is not installed: "
                              "pip install -e '.[tracking]' or set logging.wandb=disabled") from exc
        self.run = wandb.init(project=cfg.logging.wandb_project, name=cfg.name, mode=mode,
                              dir=str(cfg.run_dir), config=cfg.to_dict(), resume="allow")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
