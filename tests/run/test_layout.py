"""Every run-directory name in one place; groups.json written and read with one schema."""
from __future__ import annotations

from pathlib import Path

import pytest

from arpo_lib.run import layout
from arpo_lib.run.layout import RunDir


def test_run_dir_paths():
    run = RunDir(Path("runs/x"))
    assert run.metrics == Path("runs/x/metrics.jsonl") and run.config == Path("runs/x/config.yaml")
    assert run.rollouts(3) == Path("runs/x/rollouts/step_000003")
    assert run.groups(3) == Path("runs/x/rollouts/step_000003/groups.json")
    assert run.checkpoints == Path("runs/x/checkpoints") and layout.step_name(12) == "step_000012"
    assert layout.screenshot_name(4) == "step_4.png" and layout.SCREENSHOT.search("step_4.png").group(1) == "4"


def _member(**changes):
    member = {"dir": "runs/x/rollouts/step_000000/miniwob/click-test/0", "task_score": 1.0, "reward": 1.0,
              "advantage": 2.47, "replayed": False, "format_ok": True, "num_steps": 2}
    return {**member, **changes}


def test_groups_round_trip_and_every_step_is_found(tmp_path):
    run = RunDir(tmp_path)
    for step in (0, 1, 10):
        records = [layout.group_record("miniwob/click-test", all_failed=False, injected=step == 1, members=[_member()])]
        layout.write_groups(run.groups(step), records)
    (run.root / "rollouts" / "step_000011").mkdir()  # a step still running: no groups.json yet
    assert [s for s, _ in run.all_groups()] == [0, 1, 10]
    (group,) = layout.read_groups(run.groups(1))
    assert group["injected"] is True and group["members"][0]["advantage"] == 2.47


def test_a_member_without_the_schema_keys_is_refused():
    with pytest.raises(ValueError, match="advantage"):
        layout.group_record("t", all_failed=True, injected=False, members=[{"dir": "d", "task_score": 0.0}])


def test_unreadable_groups_read_as_none(tmp_path):
    path = tmp_path / "groups.json"
    path.write_text('[{"task": "a"}, 3')
    assert layout.read_groups(path) == [] and layout.read_groups(tmp_path / "missing.json") == []
