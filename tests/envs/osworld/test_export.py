"""Evaluation results mirrored into OSWorld's own layout, read back the way its show_result.py
reads them."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from arpo_lib.envs.osworld.export import export_osworld_results, read_osworld_results
from arpo_lib.training.rollout import save_trajectory
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
    save_trajectory(t, root / domain / name / str(sample), shots)


def test_one_sample_per_task_gives_osworld_layout(tmp_path):
    ev = tmp_path / "eval"
    _traj(ev, "miniwob/click-test", 0, 1.0)
    _traj(ev, "miniwob/click-button", 0, 0.0)
    _traj(ev, "miniwob/enter-text", 0, 0.0, status="env_error")
    model_dir = export_osworld_results(ev, tmp_path / "results", "tiny-model")
    assert model_dir == tmp_path / "results" / "pyautogui" / "screenshot" / "tiny-model"
    example = model_dir / "miniwob" / "click-test"
    assert (example / "result.txt").read_text() == "1.0\n"
    lines = [json.loads(x) for x in (example / "traj.jsonl").read_text().splitlines()]
    assert [x["step_num"] for x in lines] == [1, 2]
    assert lines[0]["action"] == "import pyautogui\npyautogui.click(10, 20)"
    assert lines[1]["action"] == "DONE"
    for x in lines:
        shot = example / x["screenshot_file"]
        assert shot.is_file() and x["screenshot_file"].startswith(f"step_{x['step_num']}_")
    # the screenshot after action 1 is our step_1.png (action 1 was taken on step_0.png)
    assert Image.open(example / lines[0]["screenshot_file"]).getpixel((0, 0)) == (40, 0, 0)
    assert Image.open(example / lines[1]["screenshot_file"]).getpixel((0, 0)) == (80, 0, 0)
    # an infrastructure failure is unfinished (no result.txt), as OSWorld's scripts treat it
    assert not (model_dir / "miniwob" / "enter-text" / "result.txt").exists()
    assert read_osworld_results(model_dir) == {"miniwob": [0.0, 1.0]}
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["success_rate"] == 0.5 and summary["unfinished"] == ["miniwob/enter-text"]
    assert "| miniwob | 2 | 50.0% |" in (model_dir / "summary.md").read_text()


def test_k_samples_become_k_runs_and_reexport_replaces(tmp_path):
    ev = tmp_path / "eval"
    for s, score in enumerate([1.0, 0.0, 1.0]):
        _traj(ev, "miniwob/click-test", s, score)
    base = export_osworld_results(ev, tmp_path / "r", "m")
    runs = sorted(p.name for p in base.iterdir())
    assert runs == ["m-sample0", "m-sample1", "m-sample2"]
    assert [read_osworld_results(base / r)["miniwob"] for r in runs] == [[1.0], [0.0], [1.0]]
    (base / "m-sample0" / "miniwob" / "stale").mkdir()
    export_osworld_results(ev, tmp_path / "r", "m")
    assert not (base / "m-sample0" / "miniwob" / "stale").exists()
