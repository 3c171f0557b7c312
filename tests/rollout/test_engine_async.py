"""Asynchronous rollouts (`rollout.mode=async`): episodes that never wait for each other.

Over real environment worker processes (the example plug-in's red boxes, one seed slowed down),
against the lockstep loop: the same trajectories, while the fast episodes no longer wait for the
slow one at every step; a policy behind a server gets one request per episode, concurrently."""
from __future__ import annotations

import threading
import time

import pytest

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest, Generation

PLUGIN = "tests.plugins.example_plugin"
SLOW = 0
"""The seed whose environment takes `SLOW_STEP_S` per step."""
SLOW_STEP_S = 1.0
MISS = "Thought: there.\nAction: click(start_box='(1,1)')"  # never inside a box: episodes run to the cap


class Scripted:
    """The tiny model's conversations and parser, a fixed response; records each generate call as
    the (seed, step) of its episodes, and how many calls ran at once."""

    def __init__(self, base, *, concurrent: bool = False, delay_s: float = 0.0):
        self.base, self.delay_s = base, delay_s
        self.concurrent_requests = concurrent
        self.new_conversation, self.parse, self.release = base.new_conversation, base.parse, base.release
        self.calls: list[list[tuple[int, int]]] = []
        self.running = self.most_at_once = 0
        self._lock = threading.Lock()

    def generate(self, segments, *, contexts=None, **kw):
        with self._lock:
            self.calls.append([(ctx.info["seed"], ctx.step) for ctx in contexts])
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.delay_s)
        ids = self.base.tokenizer(MISS, add_special_tokens=False)["input_ids"] + [self.base.eos_ids[0]]
        with self._lock:
            self.running -= 1
        return [Generation(MISS, ids, [0.0] * len(ids)) for _ in segments]


@pytest.fixture(scope="module")
def base(tiny_qwen2vl):
    from arpo_lib.agent.hf_policy import HFPolicy

    return HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=24, history_images=3)


@pytest.fixture(scope="module")
def pool():
    options = {"max_steps": 3, "slow_seeds": [SLOW], "slow_step_s": SLOW_STEP_S}
    with EnvPool(4, options, timeout_s=60, plugins=[PLUGIN]) as pool:
        yield pool


def _run(policy, pool, mode, tmp_path, **options):
    finished: list[int] = []
    engine = RolloutEngine(policy, pool, max_steps=3, mode=mode, **options)
    trajs = engine.run([EpisodeRequest("example/click-box", seed, 0) for seed in range(4)], progress=False,
                       out_dir=tmp_path / mode, on_finish=lambda t: finished.append(t.seed))
    return trajs, finished, engine


def _summary(trajs):
    return [(t.seed, t.status, t.task_score, [(s.response, s.actions, s.reward) for s in t.steps]) for t in trajs]


def test_fast_episodes_do_not_wait_for_a_slow_environment(base, pool, tmp_path):
    """Lockstep: every batch holds each live episode at the same step, so the fast ones wait for the
    slow environment at every step and all end in the same tick. Async: the fast episodes play their
    three steps while the slow one is still in its first, and end first. The trajectories are the same."""
    lock = Scripted(base)
    lock_trajs, lock_finished, lock_engine = _run(lock, pool, "lockstep", tmp_path)
    assert all(len({step for _, step in call}) == 1 for call in lock.calls)  # a tick: one step for all
    assert [len(call) for call in lock.calls] == [4, 4, 4]

    fast = Scripted(base)
    async_trajs, async_finished, async_engine = _run(fast, pool, "async", tmp_path, gather_window_s=0.05)
    assert _summary(async_trajs) == _summary(lock_trajs)
    assert async_finished[-1] == SLOW and sorted(async_finished[:3]) == [1, 2, 3]
    slow_steps = [step for call in fast.calls for seed, step in call if seed == SLOW]
    first_slow_step_1 = next(i for i, call in enumerate(fast.calls) if (SLOW, 1) in call)
    fast_before = {(seed, step) for call in fast.calls[:first_slow_step_1] for seed, step in call if seed != SLOW}
    assert {(seed, 2) for seed in (1, 2, 3)} <= fast_before  # their last step came before the slow one's second
    assert slow_steps == [0, 1, 2] and all(len(call) <= 4 for call in fast.calls)
    for engine in (lock_engine, async_engine):
        busy = engine.busy.fractions()
        assert 0.0 < busy["env_busy_fraction"] <= 1.0 and 0.0 <= busy["generator_busy_fraction"] <= 1.0


def test_a_server_policy_gets_one_request_per_episode_at_once(base, pool, tmp_path):
    """Through a server (`concurrent_requests`), each episode's request goes as soon as its
    observation is in, from its own thread: requests overlap, each holds one episode."""
    served = Scripted(base, concurrent=True, delay_s=0.2)
    trajs, finished, _ = _run(served, pool, "async", tmp_path)
    assert all(len(call) == 1 for call in served.calls) and len(served.calls) == 12
    assert served.most_at_once > 1
    assert finished[-1] == SLOW and all(t.ok and len(t.steps) == 3 for t in trajs)
    lock = Scripted(base, concurrent=True, delay_s=0.2)
    _run(lock, pool, "lockstep", tmp_path / "lock")
    assert lock.most_at_once == 1 and len(lock.calls) == 3  # lockstep: one batched call per tick


def test_async_generation_in_process_draws_the_tokens_lockstep_draws(base, pool, tmp_path):
    """The tiny model generating for real (T=1): each episode samples with its own seed stream, so
    the batches async makes (others than lockstep's) draw the same tokens and log-probs."""
    lock_trajs, _, _ = _run(base, pool, "lockstep", tmp_path)
    async_trajs, _, _ = _run(base, pool, "async", tmp_path, gather_window_s=0.0)
    for a, b in zip(lock_trajs, async_trajs):
        assert [s.response for s in a.steps] == [s.response for s in b.steps]
        assert len(a.segments) == len(b.segments) > 0
        for sa, sb in zip(a.segments, b.segments):
            assert sa.input_ids == sb.input_ids and sa.loss_mask == sb.loss_mask
            assert sa.behaviour_logprobs == pytest.approx(sb.behaviour_logprobs, abs=2e-4)


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="mode must be 'lockstep' or 'async'"):
        RolloutEngine(None, [], mode="eager")  # type: ignore[arg-type]


def test_the_run_config_sets_how_the_engines_schedule(tmp_path):
    from arpo_lib import build
    from arpo_lib.run.config import ConfigError, load_config
    from arpo_lib.run.layout import RunDir
    from arpo_lib.training.backend import SingleProcess
    from arpo_lib.training.rollout_source import RolloutSource

    cfg = load_config("configs/smoke.yaml", ["rollout.mode=async", "rollout.max_batch=2", "rollout.gather_window_s=0"])
    options = build.engine_options(cfg)
    assert options == {"mode": "async", "gather_window_s": 0.0, "max_batch": 2}
    source = RolloutSource("trained", ["example/click-box"], lambda: None, SingleProcess(policy=None), served=None,
                           run=RunDir(tmp_path), group_size=2, temperature=1.0, top_p=1.0, max_steps=2,
                           format_coef=0.5, format_penalty=-1.0, seed=0, progress=False, engine_options=options)
    engine = source.engine(0)
    assert (engine.mode, engine.gather_window_s, engine.max_batch) == ("async", 0.0, 2)
    assert build.engine_options(load_config("configs/smoke.yaml"))["mode"] == "lockstep"  # the default
    for bad in ("rollout.mode=eager", "rollout.max_batch=-1", "rollout.gather_window_s=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config("configs/smoke.yaml", [bad])


def test_shared_workers_go_to_the_oldest_batch_that_wants_one():
    from arpo_lib.rollout.engine import SharedWorkers

    shared = SharedWorkers()
    shared.want(1, True)
    assert shared.take(0, 1) and shared.take(0, 1)  # free: batch 1 holds it (again)
    shared.want(0, True)  # an older batch has episodes to start
    assert not shared.take(1, 1)  # a free worker goes to it, not to batch 1
    assert not shared.take(0, 0)  # held by batch 1, mid-episode
    assert not shared.take(0, 1) and shared.take(0, 0)  # between two episodes batch 1 gives it back
    shared.want(0, False)
    assert shared.take(1, 1) and not shared.take(1, 2)
    shared.give(1, 2)  # not its holder: nothing happens
    assert not shared.take(1, 0)
    shared.leave(1)
    assert shared.take(1, 0)


def test_the_next_batch_starts_on_the_environments_a_batch_no_longer_needs(base, pool, tmp_path):
    """Batches that run at once share the environments (`SharedWorkers`, rollout.max_staleness):
    batch 1 starts no episode while batch 0 has one left to start, then plays on the workers that
    batch 0's fast episodes left, while batch 0's slow episode is still running: it has finished
    before batch 0 has. Every episode of both is complete."""
    from arpo_lib.rollout.engine import SharedWorkers

    events: list[tuple[float, str, int]] = []

    class Logged(SharedWorkers):
        def want(self, batch, wanting):
            if not wanting:
                events.append((time.monotonic(), "started all", batch))
            super().want(batch, wanting)

        def take(self, worker, batch):
            held = self._holder.get(worker) == batch
            ok = super().take(worker, batch)
            if ok and not held:
                events.append((time.monotonic(), "took", batch))
            return ok

    shared, done = Logged(), {}
    shared.want(0, True)  # as RolloutSource.run_ahead: the batch about to start here goes first

    def play(batch: int, seeds: range) -> None:
        engine = RolloutEngine(Scripted(base, concurrent=True), pool, max_steps=3, mode="async",
                               shared=shared, batch=batch)
        done[batch] = engine.run([EpisodeRequest("example/click-box", s, 0) for s in seeds], progress=False,
                                 out_dir=tmp_path / str(batch))
        events.append((time.monotonic(), "finished", batch))

    ahead = threading.Thread(target=play, args=(1, range(100, 104)))
    ahead.start()
    play(0, range(SLOW, SLOW + 6))  # 6 episodes on 4 workers; seed SLOW takes 1 s a step
    ahead.join(60)
    when = {(what, b): t for t, what, b in reversed(events)}  # each event's first time
    first_take_1 = min(t for t, what, b in events if what == "took" and b == 1)
    assert first_take_1 >= when[("started all", 0)]
    assert when[("finished", 1)] < when[("finished", 0)]
    assert [len(t.steps) for t in done[0] + done[1]] == [3] * 10 and all(t.ok for t in done[0] + done[1])
    assert not shared._holder and not shared._wanting
