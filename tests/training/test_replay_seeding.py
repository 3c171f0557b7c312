"""The replay buffer seeded with stored successes of the policy itself (`algo.replay.seed_from`,
the comparison's `arpo_seeded` arm): which stored trajectories go in, and what a missing
directory does."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from arpo_lib.algo import ReplayBuffer
from arpo_lib.rollout.store import write_trajectory
from arpo_lib.training.sft import seed_replay_from
from arpo_lib.types import StepRecord, Trajectory


def _stored(root: Path, task: str, sample: int, score: float, status: str = "ok") -> Path:
    t = Trajectory(task=task, seed=7, sample=sample, instruction="click", task_score=score, status=status,
                   reward=score)
    t.steps.append(StepRecord(step=1, response="Action: click(start_box='(1,2)')",
                              actions=[{"kind": "click", "point": [1.0, 2.0], "end_point": None, "keys": [],
                                        "text": None, "direction": None}],
                              parse_error=None, reward=score, terminated=True, truncated=False, seconds=0.1))
    directory = root / task.replace("/", "_") / str(sample)
    write_trajectory(t, directory, [Image.new("RGB", (32, 32)), Image.new("RGB", (32, 32))])
    return directory


def test_successes_of_the_runs_tasks_go_in_the_rest_do_not(tmp_path):
    root = tmp_path / "selection" / "trajectories"
    won = _stored(root, "miniwob/click-test@0", 0, 1.0)
    _stored(root, "miniwob/click-test@0", 1, 0.0)                      # a failure
    _stored(root, "miniwob/click-test@0", 2, 1.0, status="env_error")  # not a valid episode
    won_b = _stored(root, "miniwob/focus-text-2@1", 0, 1.0)
    _stored(root, "miniwob/click-dialog@0", 0, 1.0)                    # a task this run does not train
    (root / "partial").mkdir()                                         # no meta.json: not a trajectory
    replay: ReplayBuffer = ReplayBuffer(capacity_per_task=8, seed=0)
    assert seed_replay_from(replay, root, ["miniwob/click-test@0", "miniwob/focus-text-2@1"]) == 2
    assert len(replay) == 2
    assert [i["dir"] for i in replay.successes("miniwob/click-test@0")] == [str(won)]
    assert [i["dir"] for i in replay.successes("miniwob/focus-text-2@1")] == [str(won_b)]
    assert replay.successes("miniwob/click-dialog@0") == []
    # an all-failed group of a seeded task gets one of them at once: before the policy solved it
    injected = replay.maybe_inject("miniwob/click-test@0", [{"dir": "x"}] * 4, [0.0] * 4)
    assert injected.injected and injected.group[injected.replaced]["dir"] == str(won)


def test_a_missing_directory_is_an_error_not_an_empty_buffer(tmp_path):
    with pytest.raises(FileNotFoundError, match="select.save_trajectories"):
        seed_replay_from(ReplayBuffer(seed=0), tmp_path / "nowhere", ["miniwob/click-test@0"])
    disabled: ReplayBuffer = ReplayBuffer(seed=0, enabled=False)  # GRPO: nothing is stored
    root = tmp_path / "t"
    _stored(root, "miniwob/click-test@0", 0, 1.0)
    assert seed_replay_from(disabled, root, ["miniwob/click-test@0"]) == 0 and len(disabled) == 0
