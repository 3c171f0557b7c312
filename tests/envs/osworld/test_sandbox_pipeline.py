"""OSWorld's own task files through the workbench's commands on the desktop sandbox, as a user
without a VM runs them (configs/osworld_sandbox.yaml): `eval` with the scripted solutions scores
them 1 by OSWorld's evaluator and writes the fork's results layout, the evaluation notebook with
the tiny model served scores them 0; one ARPO training step on two
real Chrome tasks completes with a served policy and Ray environment actors, the all-failed groups
taking a replayed scripted success."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_lib.envs.osworld import tasks as ot

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
REAL_TASKS = REPO / "test_data" / "osworld_tasks"  # four of OSWorld's own task files, unchanged
CHROME = ["2ae9ba84-3a0d-4d4c-8338-3a1478dc5fe3", "bb5e4c0d-f964-439c-97b6-bdb9747de3f4"]
INFEASIBLE = "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa"
TERMINAL = "e0df059f-28a6-4169-924f-b9623e7184cc"
"""An OS-domain task solved as an agent on OSWorld's VM solves it: Ctrl+Alt+T opens GNOME Terminal,
then a typed `mv`."""


@pytest.fixture(scope="module")
def task_cache(tmp_path_factory) -> Path:
    """A task cache holding the four real task files in OSWorld's tree layout, fetched as
    `osworld-tasks fetch --source <checkout>` fetches."""
    from benchmarks.common import osworld_test_task_cache

    return osworld_test_task_cache(tmp_path_factory.mktemp("osworld"))


def _arpo(args: list[str], osworld_python: str, cache: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARPO_OSWORLD_PYTHON": osworld_python, ot.ENV_VAR: str(cache)}
    return subprocess.run([sys.executable, "-m", "arpo_lib", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.long  # the scoring: test_sandbox_provider.py; serving and Ray: the ARPO step below
def test_eval_scores_osworlds_tasks_1_with_the_scripted_solutions_and_0_with_the_tiny_model_served(
        osworld_python, task_cache, tmp_path, tiny_qwen25vl, monkeypatch):
    done = _arpo(["eval", "--config", "configs/osworld_sandbox.yaml", "eval.policy=scripted",
                  "eval.protocol=arpo_train", f"model.path={tiny_qwen25vl}", f"out_dir={tmp_path}",
                  "logging.progress=false"], osworld_python, task_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results_file = next((tmp_path / "osworld-sandbox" / "eval").glob("*/results.json"))
    results = json.loads(results_file.read_text())
    assert results["episodes"] == 4 and results["env_errors"] == 0, results
    assert {r["task"]: r["success_rate"] for r in results["tasks"]} == {
        f"osworld/{t}": 1.0 for t in [*CHROME, INFEASIBLE, TERMINAL]}, results["tasks"]
    # which checkers scored it: the tests' environment is PyPI's 1.0.2 (no pause())
    assert results["desktop_env"]["label"] == "pypi desktop-env 1.0.2", results["desktop_env"]
    assert results["desktop_env"]["has_pause"] is False
    assert json.loads((tmp_path / "osworld-sandbox" / "desktop_env.json").read_text())["label"] == \
        "pypi desktop-env 1.0.2"
    # the OSWorld fork's layout: <model>/<trial>/<domain>/<task>/result.txt, read by its pass_at_n.py
    model_dir = results_file.parent / "osworld_results" / "pyautogui" / "screenshot" / tiny_qwen25vl.name
    scores = {p.parent.name: float(p.read_text()) for p in model_dir.glob("0/*/*/result.txt")}
    assert scores == {t: 1.0 for t in [*CHROME, INFEASIBLE, TERMINAL]}
    # The tiny model through a served policy (the workbench's HF server), in the evaluation
    # notebook run by papermill: its episodes leave the state unsolved, and OSWorld's checkers,
    # reading the same files, score 0.
    from arpo_lib.workflows import execute_notebook

    monkeypatch.setenv("ARPO_OSWORLD_PYTHON", osworld_python)  # the notebook's kernel inherits these
    monkeypatch.setenv(ot.ENV_VAR, str(task_cache))
    served = tmp_path / "served"
    out = execute_notebook("notebooks/evaluation.ipynb", {"config": "configs/osworld_sandbox.yaml", "overrides": [
        "eval.protocol=arpo_train", f"model.path={tiny_qwen25vl}", "rollout.backend=server", "serve.backend=hf",
        "model.max_new_tokens=16", "model.history_images=1", f"out_dir={served}", "logging.progress=false"]},
        run_name="osworld-sandbox-eval", out_dir=served)
    cells = json.loads(out.read_text())["cells"]
    errors = [o.get("evalue") for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    results = json.loads(next(served.rglob("results.json")).read_text())
    assert results["episodes"] == 4 and results["env_errors"] == 0 and results["checker_errors"] == 0, results
    assert {r["task"]: r["success_rate"] for r in results["tasks"]} == {
        f"osworld/{t}": 0.0 for t in [*CHROME, INFEASIBLE, TERMINAL]}, results["tasks"]


def test_one_arpo_step_on_real_osworld_tasks_with_a_served_policy_and_ray_actors(osworld_python, task_cache,
                                                                                 tmp_path, tiny_qwen25vl):
    """The tiny model fails every episode; the buffer, seeded with the scripted solutions' episodes
    (scored 1 by OSWorld's evaluator in the sandbox), puts a success into each all-failed group,
    and the update has a gradient. The episodes run asynchronously (rollout.mode=async: each asks
    the server as soon as its own desktop has answered)."""
    done = _arpo(["train", "--config", "configs/osworld_sandbox.yaml", f"model.path={tiny_qwen25vl}",
                  f"env.tasks=[osworld/{CHROME[0]},osworld/{CHROME[1]}]", "train.steps=1", "rollout.group_size=2",
                  "env.max_steps=12", "model.max_new_tokens=16", "model.history_images=1",
                  "rollout.backend=server", "serve.backend=hf", "rollout.mode=async", "env.backend=ray",
                  "train.demo_replay=1",
                  "warm_start.demos_per_task=1", "warm_start.steps=1", f"out_dir={tmp_path}", "logging.progress=false"],
                 osworld_python, task_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "osworld-sandbox" / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert last["step"] == 1 and last["env_errors"] == 0 and last["checker_errors"] == 0, last
    assert sorted(last["tasks"]) == sorted(f"osworld/{t}" for t in CHROME)
    assert last["env_steps"] >= 4 and last["server_requests"] >= 4  # 2 tasks x 2 episodes through the server
    assert last["replay_injections"] >= 1 and last["grad_norm"] > 0, last


FORK_SOURCE = os.environ.get("ARPO_DESKTOP_ENV_SOURCE")


@pytest.mark.skipif(not FORK_SOURCE, reason="the ARPO fork's desktop_env needs GitHub or a local copy of its tree: "
                    "set ARPO_DESKTOP_ENV_SOURCE=<OSWorld tree> to run this")
def test_the_forks_desktop_env_installed_by_the_setup_script_scores_them_alike(task_cache, tmp_path, tiny_qwen25vl):
    """`setup-osworld --light` (the fork: the default) from a local copy of the fork's tree; the
    same three tasks scored by the fork's checkers, and results.json says so."""
    import sysconfig

    from arpo_lib.envs.osworld.env import workbench_cache

    env = {**os.environ, "ARPO_OSWORLD_VENV": str(workbench_cache() / "test-venv-osworld-fork"),
           "ARPO_OSWORLD_TORCH_FROM": sysconfig.get_paths()["purelib"]}
    done = subprocess.run(["bash", "scripts/setup_osworld.sh", "--light"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    fork_python = done.stdout.strip().splitlines()[-1]
    done = _arpo(["eval", "--config", "configs/osworld_sandbox.yaml", "eval.policy=scripted",
                  "eval.protocol=arpo_train", f"model.path={tiny_qwen25vl}", f"out_dir={tmp_path}",
                  "logging.progress=false"], fork_python, task_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next((tmp_path / "osworld-sandbox" / "eval").glob("*/results.json")).read_text())
    assert results["desktop_env"]["source"] == "fork" and results["desktop_env"]["has_pause"] is True, \
        results["desktop_env"]
    assert results["desktop_env"]["label"].startswith("fork (local copy "), results["desktop_env"]
    assert {r["task"]: r["success_rate"] for r in results["tasks"]} == {
        f"osworld/{t}": 1.0 for t in [*CHROME, INFEASIBLE]}, results["tasks"]
