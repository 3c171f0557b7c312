"""A notebook's first steps: its papermill parameters checked, the repository root as working
directory, and the run's config loaded (every notebook and most CLI commands start here)."""
from __future__ import annotations

import logging
import os
import time
import types
from pathlib import Path
from typing import Any

from arpo_lib import build
from arpo_lib.run.config import RunConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]

NOTEBOOK_PARAMETERS = ("config", "overrides", "run_name")
"""Every notebook's papermill parameters: they map 1:1 onto the run config."""


def check_parameters(namespace: dict[str, Any], allowed: tuple[str, ...] = NOTEBOOK_PARAMETERS) -> None:
    """Fail on a misspelt papermill parameter instead of silently using a default.

    papermill only warns about a parameter the notebook does not declare, and injects it as a
    variable nobody reads. In a freshly started kernel (how papermill and nbval run notebooks),
    the only public names before this call are the parameters, so any other one is a mistake.
    In a kernel where the user already ran other cells, the check cannot tell and stays quiet.
    """
    ip = namespace.get("get_ipython")
    # (papermill and nbval spend one hidden execution; the check cell is the 2nd or 3rd visible one)
    fresh = ip is not None and ip().execution_count <= 5
    if not fresh:
        return
    ignore = {"In", "Out", "get_ipython", "exit", "quit", "open"}
    unknown = sorted(k for k, v in namespace.items() if not k.startswith("_") and k not in ignore
                     and k not in allowed and not isinstance(v, types.ModuleType))
    if unknown:
        raise ValueError(f"unknown notebook parameter(s) {unknown}: this notebook takes {list(allowed)}; "
                         "other settings go into `overrides` as dotted keys, e.g. -p overrides '[\"train.steps=5\"]'")


def use_repo_root() -> Path:
    """Run from the repository root (notebooks live in notebooks/, configs and runs at the top)."""
    if Path.cwd().resolve() != REPO_ROOT:
        os.chdir(REPO_ROOT)
    return REPO_ROOT


def prepare_run(config: str | None, overrides: list[str] | dict[str, Any] | None = None,
                run_name: str | None = None, prefix: str = "run") -> RunConfig:
    """Load a config for a notebook or CLI run; the run name defaults to `<prefix>-<time>`."""
    use_repo_root()
    overrides = list(overrides or []) if not isinstance(overrides, dict) else [f"{k}={v}" for k, v in overrides.items()]
    name = run_name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = build.load_config(config, overrides + [f"name={name}"])
    ensure_prebuilt_model(cfg.model.path)
    log.info("run directory: %s", cfg.run_dir)
    return cfg


PREBUILT_WARM_STARTS = {"models/small-uitars-qwen2vl-smoke": "configs/smoke_warm_start.yaml"}
"""Warm-started models the workbench makes once (`./workbench setup`, the first `./workbench
smoke`, or `./workbench build-warm-start`): model directory -> the config whose warm start makes
it (`experiments.build_warm_start_model`)."""


def ensure_prebuilt_model(model_path: str) -> None:
    """FileNotFoundError naming the command that makes it, when `model_path` is one of
    `PREBUILT_WARM_STARTS` and not made yet (a notebook run before `./workbench setup`)."""
    key = Path(model_path).as_posix().removeprefix("./")
    if key in PREBUILT_WARM_STARTS and not (REPO_ROOT / key / ".complete").is_file():
        raise FileNotFoundError(f"{key} is a warm start the workbench makes once ({PREBUILT_WARM_STARTS[key]}, about "
                                "4 min on 2 cores): run `./workbench setup` (or `./workbench build-warm-start`) first")
