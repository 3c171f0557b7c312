"""ARPO on OSWorld's own tasks for several steps, on the desktop sandbox (OSWorld's computer:
GNOME, Chrome, GNOME Terminal; OSWorld's DesktopEnv, set-up and evaluator unchanged), run through
notebooks/subset_training.ipynb with papermill, as a user runs it.

The tasks: the four OSWorld task files in test_data/osworld_tasks (two Chrome settings tasks, the
infeasible Bluetooth one, the GNOME Terminal rename), so the run needs no task download. The
policy: the tiny UI-TARS-architecture model (models/tiny-uitars-qwen25vl, built by the set-up),
warm-started on the scripted solutions' demonstrations; the replay buffer is seeded with those
solutions' episodes (train.demo_replay), so a group the policy fails entirely takes a replayed success.

    python benchmarks/run_osworld_arpo.py                 # 6 steps (about 15 min on 2 cores)
    python benchmarks/run_osworld_arpo.py --steps 2       # a shorter run

Writes benchmarks/results/osworld_arpo.json (per step: success, replay injections, environment
and checker failures, the buffer, the update's loss and gradient norm) and the executed notebook,
benchmarks/results/osworld_arpo_subset_training.ipynb. Needs the OSWorld interpreter
(./workbench setup-osworld --light) and the desktop's applications (./workbench setup-desktop --osworld).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import OSWORLD_TEST_TASKS, osworld_test_task_cache, write_result  # noqa: E402

STEP_KEYS = ("step", "tasks", "success_rate", "success_by_task", "all_failed_groups", "replay_injections",
             "replay_size", "env_errors", "setup_failed", "checker_errors", "mean_steps", "env_steps", "loss",
             "grad_norm", "seconds_rollout", "seconds_update")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-uitars-qwen25vl"))
    parser.add_argument("--warm-start-steps", type=int, default=150, help="SFT steps on the scripted demonstrations")
    parser.add_argument("--keep", help="keep the run directory here (default: a temporary one, removed)")
    args = parser.parse_args(argv)

    from arpo_lib.envs.osworld import tasks as ot
    from arpo_lib.envs.osworld.machine import find_osworld_python
    from arpo_lib.workflows import execute_notebook

    work = Path(args.keep or tempfile.mkdtemp(prefix="arpo-osworld-run-"))
    os.environ[ot.ENV_VAR] = str(osworld_test_task_cache(work / "tasks"))
    python = os.environ.get("ARPO_OSWORLD_PYTHON") or find_osworld_python()
    if not python:
        parser.error("no OSWorld interpreter: ./workbench setup-osworld --light (or set ARPO_OSWORLD_PYTHON)")
    os.environ["ARPO_OSWORLD_PYTHON"] = python
    tasks = [f"osworld/{t}" for ids in OSWORLD_TEST_TASKS.values() for t in ids]
    overrides = [f"model.path={args.model}", f"env.tasks=[{','.join(tasks)}]", f"train.steps={args.steps}",
                 "train.tasks_per_batch=2", "rollout.group_size=2", "env.max_steps=12", "model.max_new_tokens=32",
                 "model.history_images=1", "train.demo_replay=1", "warm_start.demos_per_task=1",
                 f"warm_start.steps={args.warm_start_steps}", f"out_dir={work / 'runs'}", "logging.progress=false"]
    started = time.monotonic()
    out = execute_notebook("notebooks/subset_training.ipynb",
                           {"config": "configs/osworld_sandbox.yaml", "overrides": overrides},
                           run_name="osworld-arpo", out_dir=work / "notebook")
    wall_s = time.monotonic() - started
    cells = json.loads(out.read_text())["cells"]
    errors = [o.get("evalue") for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    metrics_file = next((work / "runs").rglob("metrics.jsonl"))
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [{k: s.get(k) for k in STEP_KEYS if k in s} for s in steps]
    result = {
        "benchmark": "osworld_arpo",
        "what": "ARPO steps on OSWorld's own task files on the desktop sandbox, through notebooks/subset_training.ipynb",
        "tasks": tasks, "model": Path(args.model).name, "overrides": overrides, "steps": rows,
        "totals": {"replay_injections": sum(r.get("replay_injections") or 0 for r in rows),
                   "env_errors": sum(r.get("env_errors") or 0 for r in rows),
                   "checker_errors": sum(r.get("checker_errors") or 0 for r in rows),
                   "wall_s": round(wall_s, 1)},
        "notebook_errors": errors,
        "command": "python benchmarks/run_osworld_arpo.py" + (f" --steps {args.steps}" if args.steps != 6 else "")
                   + (f" --warm-start-steps {args.warm_start_steps}" if args.warm_start_steps != 150 else ""),
    }
    path = write_result("osworld_arpo", result)
    shutil.copy(out, path.with_name("osworld_arpo_subset_training.ipynb"))
    print(json.dumps(result["totals"]), "\n", path)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
