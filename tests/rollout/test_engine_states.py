"""An episode's states, over environments and a policy in this process (no browser, no model):
each kind of episode goes through the same states in lockstep, async and async through a server."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from arpo_lib.actions import Action, ActionParseError, ConverterError
from arpo_lib.envs.base import EnvError
from arpo_lib.rollout import engine as rollout_engine
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.rules import RolloutRules
from arpo_lib.types import EpisodeRequest, Generation, Trajectory

SCREEN = Image.new("RGB", (8, 8))
PATHS = {
    "play": ["resetting", "waiting", "generating", "stepping", "waiting", "generating", "stepping", "finished"],
    "skip": ["resetting", "finished"],  # its set-up is skipped
    "broken": ["finished"],  # its reset cannot be sent
    "refused": ["resetting", "waiting", "generating", "finished"],  # the converter raises: left unfinished
    "garbled": ["resetting", "waiting", "generating", "stepping", "finished"],  # a format failure: DONE
}
STATUSES = {"play": "ok", "skip": "setup_failed", "broken": "env_error", "refused": "unfinished", "garbled": "ok"}


class Worker:
    """Answers at once; an episode ends at its second step."""

    def __init__(self) -> None:
        self.steps, self.answer = 0, None

    def send(self, cmd, payload):
        if cmd == "reset":
            task, self.steps = payload[0], 0
            if task == "broken":
                raise EnvError("the browser is gone")
            info = {"setup_skipped": True, "setup_failures": ["no window"]} if task == "skip" else {}
            self.answer = (SimpleNamespace(instruction=task, screenshot=SCREEN), info)
        else:
            self.steps += 1
            self.answer = (SimpleNamespace(screenshot=SCREEN), 1.0, self.steps == 2, False, {})

    def ready(self):
        return True

    def recv(self):
        return self.answer


class Pool:
    def __init__(self, n: int) -> None:
        self.workers = [Worker() for _ in range(n)]

    def __len__(self) -> int:
        return len(self.workers)


class Conversation:
    def __init__(self) -> None:
        self.responses: list[str] = []
        self.segments: list = []
        self.current: list = []

    def add_observation(self, screenshot) -> None:
        pass

    def add_response(self, text, token_ids, logprobs) -> None:
        self.responses.append(text)


class TaskNamePolicy:
    """Responds with the episode's task name: `refused` makes the converter raise, `garbled` cannot be parsed."""

    def __init__(self, concurrent: bool) -> None:
        self.concurrent_requests = concurrent
        self.conversations: dict[str, Conversation] = {}

    def new_conversation(self, instruction):
        return self.conversations.setdefault(instruction, Conversation())

    def generate(self, segments, *, contexts, **kw):
        return [Generation(ctx.task, [1], [0.0]) for ctx in contexts]

    def parse(self, text, image_size, rules="workbench"):
        if text == "refused":
            raise ConverterError("no such key")
        if text == "garbled":
            raise ActionParseError("no Action: line")
        return SimpleNamespace(actions=[Action("wait")])

    def release(self, key) -> None:
        pass


class LeavesUnfinished(RolloutRules):
    parse_attempts = 2

    def unfinished(self, why):
        return why


@pytest.mark.parametrize("mode, concurrent", [("lockstep", False), ("async", False), ("async", True)])
def test_every_kind_of_episode_goes_through_the_same_states(mode, concurrent, monkeypatch):
    paths: dict[str, list[str]] = {}
    move = rollout_engine._Episode.move

    def recorded(ep, to):
        move(ep, to)
        paths.setdefault(ep.request.task, []).append(to.value)

    monkeypatch.setattr(rollout_engine._Episode, "move", recorded)
    policy = TaskNamePolicy(concurrent)
    engine = RolloutEngine(policy, Pool(2), max_steps=3, rules=LeavesUnfinished(), mode=mode, gather_window_s=0.0)
    trajs = engine.run([EpisodeRequest(task, 0) for task in PATHS], progress=False)
    assert paths == PATHS
    assert {t.task: t.status.value for t in trajs} == STATUSES
    assert [t.format_ok for t in trajs] == [True, True, True, True, False]
    for t in trajs:  # each response the model was shown is recorded once, in its step
        if t.task in policy.conversations:
            assert policy.conversations[t.task].responses == [s.response for s in t.steps]
    assert next(t for t in trajs if t.task == "garbled").steps[0].discarded == ["garbled"]


def test_an_episode_cannot_skip_a_state():
    ep = rollout_engine._Episode(EpisodeRequest("play", 0), 0, Trajectory(task="play", seed=0, sample=0))
    with pytest.raises(RuntimeError, match="from starting to waiting"):
        ep.move(rollout_engine._State.WAITING)
