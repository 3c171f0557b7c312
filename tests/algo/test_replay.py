"""ARPO's replay buffer: storing, injecting, determinism and checkpointing."""
import collections
import copy
import json

import pytest

from arpo_lib.algo import ReplayBuffer

FAILED = [0.0] * 8


def traj(n: int) -> dict:
    return {"dir": f"runs/x/traj_{n}", "steps": n}


def filled(n: int = 8, **kwargs) -> ReplayBuffer:
    buffer = ReplayBuffer(**kwargs)
    for i in range(n):
        assert buffer.add("task", traj(i), 1.0)
    return buffer


def test_stores_only_scores_strictly_above_the_threshold():
    buffer = ReplayBuffer()
    assert buffer.add("t", traj(0), 0.1) is False
    assert buffer.add("t", traj(1), 0.0) is False
    assert buffer.add("t", traj(2), 0.1000001) is True
    assert buffer.successes("t") == [traj(2)]
    assert "t" in buffer and "other" not in buffer and 3 not in buffer


def test_fifo_eviction_per_task():
    buffer = ReplayBuffer(capacity_per_task=3)
    for i in range(5):
        buffer.add("a", traj(i), 1.0)
    buffer.add("b", traj(99), 0.5)
    assert buffer.successes("a") == [traj(2), traj(3), traj(4)]
    assert buffer.successes("b") == [traj(99)]
    assert len(buffer) == 4
    assert buffer.stats() == {"tasks_with_successes": 2, "stored": 4, "added": 6, "injections": 0}


def test_injects_into_the_first_slot_of_an_all_failed_group():
    buffer = ReplayBuffer()
    buffer.add("task", traj(7), 0.9)
    group = [traj(100 + i) for i in range(8)]
    r = buffer.maybe_inject("task", group, FAILED)
    new_group, new_scores, injected = r.group, r.scores, r.injected
    assert injected and r.replaced == 0 and r.all_failed
    assert new_group[0] == traj(7) and new_scores[0] == 0.9
    assert new_group[1:] == group[1:] and new_scores[1:] == FAILED[1:]
    assert buffer.stats()["injections"] == 1


@pytest.mark.parametrize(
    "scores",
    [
        [1.0] + [0.0] * 7,  # mixed
        [1.0] * 8,  # all successes
        [0.3] * 8,  # flat but mean >= 0.2
    ],
)
def test_leaves_groups_with_signal_or_successes_alone(scores):
    buffer = filled()
    group = [traj(100 + i) for i in range(8)]
    r = buffer.maybe_inject("task", group, scores)
    new_group, new_scores, injected = r.group, r.scores, r.injected
    assert not injected and new_group == group and new_scores == scores
    assert r.replaced is None and not r.all_failed
    assert buffer.stats()["injections"] == 0


def test_no_injection_without_stored_success_for_that_task():
    buffer = filled()
    r = buffer.maybe_inject("another-task", [traj(1)] * 8, FAILED)
    assert not r.injected
    assert r.all_failed and r.replaced is None  # all-failed is reported even when nothing can be injected


def test_inputs_are_never_mutated_and_outputs_are_copies():
    buffer = filled()
    group = [traj(100 + i) for i in range(8)]
    scores = list(FAILED)
    group_before, scores_before = copy.deepcopy(group), list(scores)
    r = buffer.maybe_inject("task", group, scores)
    new_group, new_scores, injected = r.group, r.scores, r.injected
    assert injected
    assert group == group_before and scores == scores_before
    assert new_group is not group and new_scores is not scores
    # editing what came back cannot corrupt the buffer
    new_group[0]["dir"] = "edited"
    buffer.successes("task")[0]["dir"] = "edited"
    assert all(item["dir"] != "edited" for item in buffer.successes("task"))


def test_items_added_are_copied_in():
    buffer = ReplayBuffer()
    item = traj(1)
    buffer.add("t", item, 1.0)
    item["dir"] = "edited"
    assert buffer.successes("t") == [traj(1)]


def test_uniform_draw_covers_every_stored_success():
    buffer = filled(8)
    counts = collections.Counter(
        buffer.maybe_inject("task", [None] * 8, FAILED).group[0]["steps"] for _ in range(4000)
    )
    assert set(counts) == set(range(8))
    # 500 expected each; with a fixed seed this is deterministic, the bounds are ~5 sigma wide
    assert all(380 < c < 620 for c in counts.values())


def draws(buffer: ReplayBuffer, n: int) -> list[int]:
    return [buffer.maybe_inject("task", [None] * 8, FAILED).group[0]["steps"] for _ in range(n)]


def test_same_seed_same_draws_other_seed_other_draws():
    assert draws(filled(seed=1), 50) == draws(filled(seed=1), 50)
    assert draws(filled(seed=1), 50) != draws(filled(seed=2), 50)


def test_save_load_round_trip_continues_the_draw_sequence(tmp_path):
    path = tmp_path / "ckpt" / "replay.json"
    buffer = filled(5, capacity_per_task=6, seed=3)
    buffer.add("other", {"dir": "o"}, 0.5)
    draws(buffer, 7)
    buffer.save(path)
    expected = draws(buffer, 30)

    loaded = ReplayBuffer.load(path)
    assert draws(loaded, 30) == expected
    assert loaded.capacity_per_task == 6 and loaded.seed == 3
    assert loaded.successes("task") == buffer.successes("task")
    assert loaded.successes("other") == [{"dir": "o"}]
    assert loaded.stats() == buffer.stats()
    # FIFO capacity survives the round trip
    for i in range(10):
        loaded.add("other", {"i": i}, 1.0)
    assert len(loaded.successes("other")) == 6
    # the write is atomic: only the final file remains, and saving again overwrites it
    loaded.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["replay.json"]


def test_loading_a_corrupt_file_raises_a_clear_error(tmp_path):
    path = tmp_path / "replay.json"
    filled().save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        ReplayBuffer.load(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a replay buffer"):
        ReplayBuffer.load(path)
    state = json.loads(text)
    del state["rng_state"]
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="malformed.*rng_state"):
        ReplayBuffer.load(path)


def test_disabled_buffer_is_plain_grpo(tmp_path):
    buffer = ReplayBuffer(enabled=False)
    assert buffer.add("task", traj(1), 1.0) is False
    assert len(buffer) == 0 and "task" not in buffer
    group = [traj(i) for i in range(8)]
    r = buffer.maybe_inject("task", group, FAILED)
    assert (r.group, r.scores, r.injected) == (group, FAILED, False)
    # even a buffer loaded with content never injects once disabled
    state = filled().state_dict()
    state["config"]["enabled"] = False
    restored = ReplayBuffer.from_state_dict(state)
    assert len(restored) == 8
    assert restored.maybe_inject("task", group, FAILED).injected is False
    path = tmp_path / "r.json"
    restored.save(path)
    assert ReplayBuffer.load(path).enabled is False


def test_rejects_what_cannot_be_checkpointed_or_compared():
    buffer = ReplayBuffer()
    with pytest.raises(TypeError, match="JSON"):
        buffer.add("t", object(), 1.0)
    with pytest.raises(TypeError, match="task_id"):
        buffer.add(3, traj(1), 1.0)
    with pytest.raises(ValueError, match="finite"):
        buffer.add("t", traj(1), float("nan"))
    with pytest.raises(ValueError, match="length"):
        buffer.maybe_inject("t", [traj(1)], [0.0, 0.0])
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity_per_task=0)
