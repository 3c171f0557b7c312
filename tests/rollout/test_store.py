"""The trajectory store: one schema, one writer, one reader.

A real trajectory (the rollout engine, the tiny model's tokens and image processor, the fake
OSWorld VM in this process: no browser, no Docker) is written and read back field by field; every
record the writer writes has exactly the schema's keys; a record that breaks the schema is refused
with an error naming the file, line and key; the viewers and the OSWorld export read through the
same reader, so they refuse the same records.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.envs.osworld.env import OSWorldEnv
from arpo_lib.envs.osworld.fake import FakeDesktopEnv, load_fake_task
from arpo_lib.evaluation.osworld_export import export_osworld_results
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.store import (META, STEP_LINE, TOKEN_SEGMENT, TrajectoryFormatError, load_trajectory,
                                    read_trajectory, step_line, trajectory_dirs)
from arpo_lib.run import layout
from arpo_lib.types import EpisodeRequest, Generation
from arpo_lib.viz import draw
from tests.evaluation.test_fork_transcript import InlinePool

RESPONSES = ["Thought: type it.\nAction: type(content='hello world\\n')", "Thought: done.\nAction: finished(content='')"]


class _Fixed:
    """The tiny model's conversations and parser, answering the fixed responses as its tokens."""

    def __init__(self, base: HFPolicy, responses: list[str]) -> None:
        self.base, self.responses = base, list(responses)
        self.coord_mode, self.release, self.parse = base.coord_mode, base.release, base.parse
        self.new_conversation = base.new_conversation

    def generate(self, segments, *, contexts=None, **_):
        out = []
        for ctx in contexts:
            text = self.responses[ctx.step]
            ids = self.base.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.base.eos_ids[0]]
            out.append(Generation(text, ids, [-0.25] * len(ids)))
        return out


@pytest.fixture(scope="module")
def written(tiny_qwen2vl, tmp_path_factory):
    """(policy, the trajectory as the engine returned it, the evaluation directory it is in)."""
    root = tmp_path_factory.mktemp("store")
    # history_images=1: the second screenshot starts a new segment, so tokens.pt holds two
    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=8, history_images=1)
    pool = InlinePool(lambda: OSWorldEnv(load_fake_task("fake-type"), provider="fake", desktop_env_class=FakeDesktopEnv,
                                         cache_root=root / "cache", download_cache=None, pause_s=0, backoff_s=0,
                                         screen_size=(448, 252), max_steps=5))
    FakeDesktopEnv.clear()
    try:
        (traj,) = RolloutEngine(_Fixed(policy, RESPONSES), pool, max_steps=5).run(
            [EpisodeRequest("osworld/fake-type", 7, 1)], out_dir=root / "eval", progress=False)
    finally:
        pool.close()
        FakeDesktopEnv.clear()
    assert traj.ok and traj.num_steps == 2 and len(traj.segments) == 2
    return policy, traj, root / "eval"


@pytest.fixture
def spare(written, tmp_path):
    """A spare of the written trajectory in its evaluation layout, to break."""
    _, traj, _ = written
    directory = tmp_path / "eval" / "osworld" / "fake-type" / "1"
    shutil.copytree(traj.directory, directory)
    return directory


def test_what_the_writer_writes_the_reader_gives_back(written):
    policy, traj, eval_dir = written
    directory = Path(traj.directory)
    assert trajectory_dirs(eval_dir) == [directory]
    stored = read_trajectory(directory, tokens=True)
    back = stored.trajectory
    assert back.summary() == traj.summary() and back.directory == traj.directory
    as_json = lambda actions: json.loads(json.dumps(actions))  # noqa: E731  (points come back as lists)
    assert back.steps == [replace(s, seconds=round(s.seconds, 3), actions=as_json(s.actions)) for s in traj.steps]
    assert [s.token_data() for s in back.segments] == [s.token_data() for s in traj.segments]
    assert stored.result == traj.task_score == 1.0
    # the screens the model saw, then the last one (after the final action)
    assert sorted(stored.screenshots) == [0, 1, 2] and stored.screenshot(3) is None
    # training on it (replay): the model inputs it was sampled from, pixels included
    loaded = load_trajectory(directory, policy.processor)
    for a, b in zip(traj.segments, loaded.segments, strict=True):
        assert a.token_data() == b.token_data()
        assert torch.equal(torch.cat(a.pixel_values), torch.cat(b.pixel_values))
        assert torch.equal(torch.stack(a.image_grid_thw), torch.stack(b.image_grid_thw))


def test_every_record_written_has_exactly_the_schemas_keys(written):
    _, traj, _ = written
    directory = Path(traj.directory)
    lines = [json.loads(x) for x in (directory / layout.STEPS).read_text().splitlines()]
    # weights_version only where rollouts ran ahead of the update (rollout.max_staleness)
    assert all(list(line) == [f.key for f in STEP_LINE if f.key != "weights_version"] for line in lines)
    assert len(lines) == 2
    assert list(json.loads((directory / layout.META).read_text())) == [f.key for f in META]
    assert all(list(seg) == [f.key for f in TOKEN_SEGMENT] for seg in torch.load(directory / layout.TOKENS))


def test_a_steps_weights_version_is_written_and_read_back(written):
    """Asynchronous ARPO: a response produced by another weight version than its trajectory's says which."""
    _, traj, _ = written
    directory = Path(traj.directory)
    _edit_line(directory, 2, lambda r: r.update(weights_version=7))
    steps = read_trajectory(directory).trajectory.steps
    assert [s.weights_version for s in steps] == [None, 7]
    assert "weights_version" in step_line(steps[1]) and "weights_version" not in step_line(steps[0])


def _edit_line(directory: Path, n: int, change) -> None:
    path = directory / layout.STEPS
    lines = path.read_text().splitlines()
    record = json.loads(lines[n - 1])
    change(record)
    lines[n - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def _edit_meta(directory: Path, change) -> None:
    meta = json.loads((directory / layout.META).read_text())
    change(meta)
    (directory / layout.META).write_text(json.dumps(meta))


BREAKAGES = {
    "a reward that is text": (lambda d: _edit_line(d, 2, lambda r: r.update(reward="high")),
                              r"traj\.jsonl:2: 'reward' is \"high\", expected int or float"),
    "done as a number": (lambda d: _edit_line(d, 1, lambda r: r.update(done=0)), r"traj\.jsonl:1: 'done' is 0"),
    "a line without its response": (lambda d: _edit_line(d, 1, lambda r: r.pop("response")),
                                    r"traj\.jsonl:1: lacks 'response'"),
    "an action that is not a record": (lambda d: _edit_line(d, 1, lambda r: r.update(action=["click"])),
                                       r"traj\.jsonl:1: 'action' must hold action records"),
    "a key the schema does not know": (lambda d: _edit_line(d, 2, lambda r: r.update(score=1)),
                                       r"traj\.jsonl:2: unknown keys \['score'\]"),
    "a torn line": (lambda d: (d / layout.STEPS).write_text((d / layout.STEPS).read_text()[:-20]),
                    r"traj\.jsonl:2: not JSON"),
    "an unknown status": (lambda d: _edit_meta(d, lambda m: m.update(status="done")),
                          r"meta\.json: 'status' is 'done', expected one of"),
    "a step count that disagrees": (lambda d: _edit_meta(d, lambda m: m.update(num_steps=3)),
                                    r"'num_steps' is 3 but .*traj\.jsonl has 2 lines"),
    "a seed that is text": (lambda d: _edit_meta(d, lambda m: m.update(seed="7")), r"meta\.json: 'seed' is \"7\""),
    "a result that is no score": (lambda d: (d / layout.RESULT).write_text("solved\n"),
                                  r"result\.txt: 'solved' is not a score"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_reader_refuses_a_malformed_record_saying_where(spare, breakage):
    breaks, message = BREAKAGES[breakage]
    breaks(spare)
    with pytest.raises(TrajectoryFormatError, match=message):
        read_trajectory(spare)


def test_token_data_is_checked_when_it_is_read(spare):
    data = torch.load(spare / layout.TOKENS)
    del data[1]["loss_mask"]
    torch.save(data, spare / layout.TOKENS)
    read_trajectory(spare)  # the steps and scores alone are fine
    with pytest.raises(TrajectoryFormatError, match=r"tokens\.pt segment 1: lacks 'loss_mask'"):
        read_trajectory(spare, tokens=True)


def test_records_written_before_a_key_existed_still_read(spare):
    """Keys with a default in the schema came later: records without them read with the default."""
    _edit_line(spare, 1, lambda r: [r.pop(k) for k in ("truncated", "seconds", "action_error", "discarded_responses")])
    _edit_meta(spare, lambda m: [m.pop(k) for k in ("replayed", "policy_version", "checker_error", "seconds", "error")])
    back = read_trajectory(spare).trajectory
    assert (back.steps[0].truncated, back.steps[0].seconds, back.steps[0].discarded) == (False, 0.0, [])
    assert (back.policy_version, back.replayed, back.error) == (0, False, None)


def test_an_incomplete_directory_is_not_a_trajectory(spare):
    (spare / layout.META).unlink()  # written last: a trajectory still being written has none
    with pytest.raises(FileNotFoundError, match="not a complete trajectory directory"):
        read_trajectory(spare)
    assert trajectory_dirs(spare.parents[2]) == []


def test_the_viewer_reads_through_the_store(written, spare):
    _, traj, _ = written
    frames = draw.load_frames(traj.directory)
    assert [f.step for f in frames] == [1, 2, 3] and frames[-1].final and frames[-1].task_score == 1.0
    assert [f.reward for f in frames[:-1]] == [s.reward for s in traj.steps]
    assert frames[0].action_text == "type(content='hello world\\n')" and frames[0].screenshot_file == "step_0.png"
    assert frames[0].extra == traj.summary()
    _edit_line(spare, 1, lambda r: r.update(reward="high"))
    with pytest.raises(TrajectoryFormatError, match="'reward'"):
        draw.load_frames(spare)


def test_the_osworld_export_reads_through_the_store(spare, tmp_path):
    model_dir = export_osworld_results(tmp_path / "eval", tmp_path / "results", "m")
    lines = [json.loads(x) for x in (model_dir / "1" / "osworld" / "fake-type" / "traj.jsonl").read_text().splitlines()]
    assert [x["prediction"] for x in lines[1:]] == RESPONSES
    assert "pyautogui.write('hello world'" in lines[1]["action"] and lines[2]["action"] == "DONE"
    assert (model_dir / "1" / "osworld" / "fake-type" / "result.txt").read_text() == "1.0\n"
    _edit_meta(spare, lambda m: m.update(status="done"))
    with pytest.raises(TrajectoryFormatError, match="'status'"):
        export_osworld_results(tmp_path / "eval", tmp_path / "results", "m")


@pytest.mark.parametrize("policy_name", ["run", "skip"])
def test_a_failed_set_up_is_kept_with_the_trajectory_and_skip_is_counted_apart(written, tmp_path, policy_name):
    """The reset's set-up failures go into the trajectory (meta.json, read back); with
    on_setup_failure=skip the episode is not played, its status is setup_failed, and the step's
    metrics count it apart from infrastructure failures."""
    from arpo_lib.training.metrics import rollout_metrics
    from arpo_lib.types import EpisodeStatus

    policy, _, _ = written
    config = load_fake_task("fake-type")
    config["fake"] = {"setup_failures": ["activate_window Terminal: no window matched 'Terminal'"]}
    pool = InlinePool(lambda: OSWorldEnv(config, provider="fake", desktop_env_class=FakeDesktopEnv,
                                         cache_root=tmp_path / "cache", download_cache=None, pause_s=0, backoff_s=0,
                                         screen_size=(448, 252), max_steps=5, on_setup_failure=policy_name))
    FakeDesktopEnv.clear()
    try:
        (traj,) = RolloutEngine(_Fixed(policy, RESPONSES), pool, max_steps=5).run(
            [EpisodeRequest("osworld/fake-type", 7, 1)], out_dir=tmp_path / "eval", progress=False)
    finally:
        pool.close()
        FakeDesktopEnv.clear()
    assert traj.setup_failures == ["activate_window Terminal: no window matched 'Terminal'"]
    assert read_trajectory(traj.directory).trajectory.setup_failures == traj.setup_failures
    metrics = rollout_metrics(["osworld/fake-type"], [traj], [])
    if policy_name == "run":
        assert traj.ok and traj.num_steps == 2 and metrics["setup_failures"] == 1 and metrics["setup_failed"] == 0
    else:
        assert traj.status == EpisodeStatus.SETUP_FAILED and traj.num_steps == 0 and not traj.ok
        assert "no window matched" in traj.error
        assert metrics["setup_failed"] == 1 and metrics["env_errors"] == 0
