"""Running a notebook headlessly (the CLI's `smoke` and `notebook`, and the notebook tests): its
parameters checked against the ones it declares, the executed copy kept in its run directory."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from arpo_lib.run.config import run_name_problem
from arpo_lib.workflows.prepare import REPO_ROOT


def execute_notebook(notebook: str | Path, parameters: dict[str, Any], run_name: str | None = None,
                     out_dir: str | Path = "runs") -> Path:
    """Execute a notebook headlessly with papermill; the executed copy goes into the run directory."""
    import papermill

    # Stream the cells' output while the notebook runs (papermill logs it at INFO).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    pm_logger = logging.getLogger("papermill")
    if not pm_logger.handlers:
        pm_logger.addHandler(handler)
    pm_logger.setLevel(logging.INFO)
    pm_logger.propagate = False
    notebook = REPO_ROOT / notebook
    declared = set(papermill.inspect_notebook(str(notebook)))
    unknown = sorted(set(parameters) - declared - {"run_name"})
    if unknown:
        raise ValueError(f"{notebook.name} has no parameter(s) {unknown}; it takes {sorted(declared)}")
    name = run_name or f"{notebook.stem.replace('_test', '')}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = run_name_problem(name)
    if problem:
        raise ValueError(f"run_name: {problem}")
    out = REPO_ROOT / out_dir / name / notebook.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(notebook), str(out), parameters={**parameters, "run_name": name},
                               cwd=str(REPO_ROOT), kernel_name="python3", log_output=True,
                               progress_bar=False)
    return out
