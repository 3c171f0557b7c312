"""Evaluation results mirrored into OSWorld's own layout, read back the way its show_result.py
reads them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from arpo_lib.evaluation.osworld_export import export_osworld_results, pass_at_n, trial_scores, trials, unfinished
from arpo_lib.rollout.store import write_trajectory
from arpo_lib.types import StepRecord, Trajectory


def _traj(root: Path, task: str, sample: int, score: float, status: str = "ok", steps: int = 2) -> None:
    t = Trajectory(task=task, seed=1, sample=sample, instruction="do it", task_score=score, status=status)
    for i in range(steps):
        kind = {"kind": "click", "point": [10.0 + i, 20.0], "end_point": None, "keys": [], "text": None,
                "direction": None}
        last = i == steps - 1
        t.steps.append(StepRecord(step=i + 1, response=f"Action: click({i})", actions=[kind] if not last else
                                  [{**kind, "kind": "finished", "point": None}], parse_error=None,
                                  reward=score if last else 0.0, terminated=last, truncated=False, seconds=0.1))
    shots = [Image.new("RGB", (64, 48), (i * 40, 0, 0)) for i in range(steps + 1)]
    domain, _, name = task.rpartition("/")
    write_trajectory(t, root / domain / name / str(sample), shots)


def test_one_sample_per_task_gives_the_forks_trial_layout(tmp_path):
    ev = tmp_path / "eval"
    _traj(ev, "miniwob/click-test", 0, 1.0)
    _traj(ev, "miniwob/click-button", 0, 0.0)
    _traj(ev, "miniwob/enter-text", 0, 0.0, status="env_error")
    model_dir = export_osworld_results(ev, tmp_path / "results", "tiny-model")
    assert model_dir == tmp_path / "results" / "pyautogui" / "screenshot" / "tiny-model"
    example = model_dir / "0" / "miniwob" / "click-test"  # trial 0
    assert (example / "result.txt").read_text() == "1.0\n"
    lines = [json.loads(x) for x in (example / "traj.jsonl").read_text().splitlines()]
    reset, *steps = lines
    assert reset["action"] == "reset" and reset["step_num"] == 0 and reset["instruction"] == "do it"
    assert reset["screenshot_file"].startswith("step_reset_") and (example / reset["screenshot_file"]).is_file()
    assert [x["step_num"] for x in steps] == [1, 2]
    assert steps[0]["action"] == "import pyautogui\npyautogui.click(10, 20)"
    assert steps[1]["action"] == "DONE"
    assert steps[0]["prediction"] == steps[0]["response"] == "Action: click(0)"  # the fork's key and ours
    for x in steps:
        shot = example / x["screenshot_file"]
        assert shot.is_file() and x["screenshot_file"].startswith(f"step_{x['step_num']}_")
    # the screenshot after action 1 is our step_1.png (action 1 was taken on step_0.png)
    assert Image.open(example / steps[0]["screenshot_file"]).getpixel((0, 0)) == (40, 0, 0)
    assert Image.open(example / steps[1]["screenshot_file"]).getpixel((0, 0)) == (80, 0, 0)
    # an infrastructure failure is unfinished (no result.txt, the fork's error line), as its runner leaves it
    failed = model_dir / "0" / "miniwob" / "enter-text"
    assert not (failed / "result.txt").exists()
    assert "Error" in json.loads((failed / "traj.jsonl").read_text().splitlines()[-1])
    # read back with readers written from the fork's documented layout
    meta = {"miniwob": ["click-test", "click-button", "enter-text"]}
    assert trials(model_dir) == [0]
    assert trial_scores(model_dir, 0) == {("miniwob", "click-test"): 1.0, ("miniwob", "click-button"): 0.0}
    assert unfinished(model_dir, 0, meta) == {"miniwob": ["enter-text"]}
    result = pass_at_n(model_dir, meta)
    assert (result["solved"], result["valid"], result["tasks"]) == (1, 2, 3)
    assert result["acc"] == 0.5 and result["acc_over_all"] == pytest.approx(1 / 3)
    summary = json.loads((tmp_path / "results" / "summary-tiny-model.json").read_text())
    assert summary["trials"]["0"]["success_rate"] == 0.5 and summary["trials"]["0"]["unfinished"] == ["miniwob/enter-text"]


def test_k_samples_become_k_trials_and_reexport_replaces(tmp_path):
    ev = tmp_path / "eval"
    for s, score in enumerate([1.0, 0.0, 1.0]):
        _traj(ev, "miniwob/click-test", s, score)
    _traj(ev, "miniwob/click-button", 0, 0.0)
    _traj(ev, "miniwob/click-button", 1, 0.0)
    model = export_osworld_results(ev, tmp_path / "r", "m")
    assert trials(model) == [0, 1, 2] and all(p.name.isdigit() for p in model.iterdir())  # pass_at_n int()s them
    assert [trial_scores(model, t)[("miniwob", "click-test")] for t in range(3)] == [1.0, 0.0, 1.0]
    result = pass_at_n(model, {"miniwob": ["click-test", "click-button"]})
    assert result["solved"] == 1 and result["per_trial"] == {0: 0.5, 1: 0.0, 2: 0.5}
    assert result["overall_acc"] == pytest.approx(2 / 5) and result["mean_acc"] == pytest.approx(1 / 3)
    (model / "0" / "miniwob" / "stale").mkdir()
    export_osworld_results(ev, tmp_path / "r", "m")
    assert not (model / "0" / "miniwob" / "stale").exists()


def test_filter_fail_zeroes_episodes_that_ran_out_and_failed(tmp_path):
    model = tmp_path / "m"
    example = model / "0" / "chrome" / "t1"
    example.mkdir(parents=True)
    lines = [{"step_num": 0, "action": "reset"}] + [{"step_num": i, "action": "WAIT"} for i in range(1, 15)] + \
            [{"step_num": 15, "action": "FAIL"}]
    (example / "traj.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (example / "result.txt").write_text("True\n")  # an infeasible task scores 1 after FAIL
    assert pass_at_n(model, {"chrome": ["t1"]})["solved"] == 1
    assert pass_at_n(model, {"chrome": ["t1"]}, filter_fail=True)["solved"] == 0


def test_an_unfinished_episode_has_no_result_here_nor_in_the_forks_layout(tmp_path):
    """A checker that raised under `osworld_uitars`: no result.txt in our directory either, and the
    fork's readers count the example as not run (unfinished), not as a failure."""
    ev = tmp_path / "eval"
    _traj(ev, "osworld/a", 0, 1.0)
    _traj(ev, "osworld/b", 0, 0.0, status="unfinished")
    assert not (ev / "osworld" / "b" / "0" / "result.txt").exists()
    assert json.loads((ev / "osworld" / "b" / "0" / "meta.json").read_text())["status"] == "unfinished"
    model_dir = export_osworld_results(ev, tmp_path / "results", "m")
    example = model_dir / "0" / "osworld" / "b"
    assert not (example / "result.txt").exists()
    assert json.loads((example / "traj.jsonl").read_text().splitlines()[-1])["Error"].startswith("unfinished in")
    meta = {"osworld": ["a", "b"]}
    assert unfinished(model_dir, 0, meta) == {"osworld": ["b"]}
    result = pass_at_n(model_dir, meta)
    assert (result["valid"], result["solved"], result["acc"]) == (1, 1, 1.0)
