"""Rollouts: run many episodes over a pool of environment workers, batching model calls.

`lockstep` (the default, ARPO's loop): each tick sends every waiting environment its command
(reset or step) so the browsers work in parallel, collects ALL the answers, then asks the policy
for the next action of every live episode in ONE batched generate call: each tick waits for the
slowest environment. `async`: an episode's next action is asked for as soon as its own
observation is in. A policy in this process generates for whatever episodes are waiting, once
`max_batch` of them are or the first has waited `gather_window_s` (or no other answer can come);
a policy behind a server (`concurrent_requests`) gets one request per episode, in threads, and
the server batches them (vLLM's continuous batching). Each episode samples with its own seed
stream either way, so an episode draws the same tokens in both modes (up to the rounding of a
different batch). Finished episodes are written by the trajectory store
(`arpo_lib.rollout.store`: OSWorld's result layout plus the token data training needs), so a
trajectory can be reloaded for training from its directory alone (the replay buffer keeps only
the path).

What differs between training and an evaluation protocol (how a response is sampled, which
action rules parse it, what replaces it, what an exception costs) the engine asks its
`RolloutRules` (`arpo_lib.rollout.rules`); it knows no protocol.
"""
from __future__ import annotations

import enum
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from arpo_lib.actions import Action, ActionParseError, ConverterError
from arpo_lib.algo import trajectory_reward
from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.worker import action_payload
from arpo_lib.rollout.rules import TRAINING_RULES, RolloutRules
from arpo_lib.rollout.store import write_trajectory
from arpo_lib.run.records import safe_join
from arpo_lib.types import (EpisodeRequest, EpisodeStatus, Policy, PolicyContext, SamplingParams, StepRecord,
                            Trajectory, WorkerPool)

if TYPE_CHECKING:
    from PIL import Image

    from arpo_lib.agent.prompt import TokenConversation


# ----------------------------------------------------------------------------- the engine

DONE = action_payload([Action("finished")])
"""What a malformed response sends the environment: end the episode (OSWorld's DONE)."""


POLL_S = 0.05
"""An asynchronous rollout with nothing to do looks at its environments again after this long."""


class SharedWorkers:
    """One pool's environments shared by rollout batches that run at once (batches sampled ahead,
    `rollout.max_staleness`): a worker belongs to one batch at a time, and a free one goes to the
    oldest batch that still has episodes to start, so a batch's stragglers no longer leave the
    other environments idle: the next batch's episodes start on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: dict[int, int] = {}  # worker -> the batch using it
        self._wanting: set[int] = set()  # batches with episodes not started yet

    def want(self, batch: int, wanting: bool) -> None:
        """Whether `batch` has episodes left to start (an older batch that wants goes first)."""
        with self._lock:
            (self._wanting.add if wanting else self._wanting.discard)(batch)

    def take(self, worker: int, batch: int) -> bool:
        """`worker` for `batch`: True when it holds it now (free, and no older batch wants one)."""
        with self._lock:
            holder = self._holder.get(worker)
            if holder not in (None, batch):
                return False
            if any(b < batch for b in self._wanting):  # (a worker between two episodes goes back too)
                self._holder.pop(worker, None)
                return False
            self._holder[worker] = batch
            return True

    def give(self, worker: int, batch: int) -> None:
        with self._lock:
            if self._holder.get(worker) == batch:
                del self._holder[worker]

    def leave(self, batch: int) -> None:
        """`batch` is over: its workers are free, it wants none."""
        with self._lock:
            self._wanting.discard(batch)
            for worker in [w for w, b in self._holder.items() if b == batch]:
                del self._holder[worker]


class BusyClock:
    """How much of a rollout's wall time the environments and the generator were busy: per
    worker, the time a command was in flight; for the generator, the time at least one
    generation was (a batch in this process, or requests to a server from several threads)."""

    def __init__(self, workers: int = 0):
        self.t0 = time.monotonic()
        self.wall = 0.0
        self.env_seconds = [0.0] * workers
        self.generator_seconds = 0.0
        self._since: dict[int, float] = {}
        self._lock = threading.Lock()
        self._generating, self._generating_since = 0, 0.0

    def env_started(self, worker: int) -> None:
        self._since.setdefault(worker, time.monotonic())

    def env_stopped(self, worker: int) -> None:
        since = self._since.pop(worker, None)
        if since is not None:
            self.env_seconds[worker] += time.monotonic() - since

    @contextmanager
    def generating(self) -> Iterator[None]:
        with self._lock:
            if not self._generating:
                self._generating_since = time.monotonic()
            self._generating += 1
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1
                if not self._generating:
                    self.generator_seconds += time.monotonic() - self._generating_since

    def stop(self) -> None:
        for worker in list(self._since):
            self.env_stopped(worker)
        self.wall = time.monotonic() - self.t0

    def fractions(self) -> dict[str, float]:
        """env_busy_fraction (mean over workers), generator_busy_fraction, of the last run's wall time."""
        wall = self.wall or (time.monotonic() - self.t0)
        envs = sum(self.env_seconds) / max(1, len(self.env_seconds)) / wall if wall else 0.0
        return {"env_busy_fraction": envs, "generator_busy_fraction": self.generator_seconds / wall if wall else 0.0}


def _version(gen: Any) -> int | None:
    """The weight version a response says produced it (a versioned server policy's), or None."""
    return getattr(gen, "weights_version", None)


class _State(enum.Enum):
    """Where an episode is in the loop (its outcome is `Trajectory.status`)."""

    STARTING = "starting"  # made for an idle worker, its reset not sent yet
    RESETTING = "resetting"  # its worker resets the environment: the first observation is coming
    STEPPING = "stepping"  # its worker carries out `pending_record`'s actions
    WAITING = "waiting"  # its observation is in, its next response not asked for yet
    GENERATING = "generating"  # its next response is being sampled (again while it cannot be parsed)
    FINISHED = "finished"  # over: it is written and leaves its worker


_MOVES = {
    _State.STARTING: {_State.RESETTING, _State.FINISHED},  # (the reset could not be sent)
    _State.RESETTING: {_State.WAITING, _State.FINISHED},  # (a set-up skipped, a worker that failed)
    _State.STEPPING: {_State.WAITING, _State.FINISHED},  # (the episode is over, or its worker failed)
    _State.WAITING: {_State.GENERATING},
    _State.GENERATING: {_State.STEPPING, _State.FINISHED},  # (lost to an exception, or the step not sent)
    _State.FINISHED: set(),
}
_IN_ENV = (_State.RESETTING, _State.STEPPING)
"""A command is in flight on the episode's worker."""


@dataclass
class _Episode:
    request: EpisodeRequest
    worker: int
    traj: Trajectory
    state: _State = _State.STARTING
    since: float = field(default_factory=time.monotonic)
    """When it entered `state`: how long a step took, and who has waited longest for a response."""
    conv: TokenConversation | None = None
    screenshots: list[Image.Image] = field(default_factory=list)
    pending_record: StepRecord | None = None
    """The step its worker is carrying out; the environment's answer completes it."""
    info: dict[str, Any] = field(default_factory=dict)
    """The environment's last info dict (scripted policies read `dom_elements` from it)."""
    started: float = field(default_factory=time.monotonic)
    rule_memory: dict[str, Any] = field(default_factory=dict)
    """What the rules keep about this episode between its steps (`RolloutRules.actions`)."""
    discarded: list[str] = field(default_factory=list)
    """This step's responses sampled again because they could not be parsed."""

    def move(self, to: _State) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"an episode cannot go from {self.state.value} to {to.value}")
        self.since = time.monotonic()  # before the state: a request's thread moves it while the loop reads it
        self.state = to


def _in_state(slots: dict[int, tuple[int, _Episode]], *states: _State) -> list[_Episode]:
    return [ep for _, ep in slots.values() if ep.state in states]


class RolloutEngine:
    """Runs episodes of a policy over an `EnvPool`."""

    def __init__(self, policy: Policy, pool: WorkerPool, *, max_steps: int = 15, format_coef: float = 0.5,
                 format_penalty: float = -1.0, rules: RolloutRules = TRAINING_RULES, keep_pixels: bool = True,
                 mode: str = "lockstep", gather_window_s: float = 0.05, max_batch: int = 0,
                 shared: SharedWorkers | None = None, batch: int = 0):
        """`rules`: training's unless an evaluation protocol gives its own
        (`evaluation.protocols.EvalProtocol.rollout_rules`). `keep_pixels=False`: a finished
        episode's segments drop their pixels once its trajectory is written (`run(out_dir=...)`),
        for a caller that re-encodes them where it needs them (`store.load_pixels`, as the policy
        update does): a 1080p screenshot is ~50 MB of fp32 pixels, up to 15 per episode, and a
        rollout batch held every finished episode's until the update (~130 GB at 32x8 episodes).
        `shared`: the pool's workers are shared with other batches running at once; this one is
        batch number `batch` (an older batch gets a free worker first)."""
        if rules.parse_attempts < 1:
            raise ValueError(f"parse_attempts must be >= 1, got {rules.parse_attempts}")
        if mode not in ("lockstep", "async"):
            raise ValueError(f"mode must be 'lockstep' or 'async', not {mode!r}")
        self.mode, self.gather_window_s, self.max_batch = mode, gather_window_s, max_batch
        self.policy = policy
        self.pool = pool
        self.max_steps = max_steps
        self.format_coef = format_coef
        self.format_penalty = format_penalty
        self.rules = rules
        self.keep_pixels = keep_pixels
        self.env_steps = 0
        self.shared, self.batch = shared, batch
        self._last_task: dict[int, str] = {}
        self.busy = BusyClock()
        """How long the environments and the generator were busy during the last `run`."""

    def run(
        self,
        requests: Sequence[EpisodeRequest],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        out_dir: str | Path | None = None,
        progress: bool = True,
        description: str = "rollout",
        on_finish: Callable[[Trajectory], None] | None = None,
        policy_version: int = 0,
    ) -> list[Trajectory]:
        """Run all requests; returns trajectories in request order, each marked with
        `policy_version` (the trainer's weight version, for the age of replayed data).

        Each turn starts episodes on the idle workers, takes environments' answers, lets the
        finished episodes leave and generates for waiting ones; the modes differ only in which
        answers a turn takes (`_answered`) and whom it generates for (`_due`)."""
        from tqdm.auto import tqdm

        self.busy = BusyClock(len(self.pool))
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        queue, results = deque(enumerate(requests)), {}
        slots: dict[int, tuple[int, _Episode]] = {}  # worker -> (request index, its episode)
        threads = ThreadPoolExecutor(max_workers=max(1, len(self.pool)), thread_name_prefix="arpo-act") \
            if self._request_per_episode else None
        in_flight: list[Future] = []  # the requests' threads (each generates for one episode)
        bar = tqdm(total=len(requests), desc=description, disable=not progress, leave=False)
        if self.shared is not None:
            self.shared.want(self.batch, bool(requests))
        try:
            while queue or slots:
                self._start_idle(queue, slots, policy_version)
                for ep in self._answered(slots, in_flight):
                    self._receive(ep)
                for request in [f for f in in_flight if f.done()]:
                    in_flight.remove(request)
                    request.result()  # an exception in a request's thread stops the run, as one here does
                self._leave(slots, results, out_dir, bar, on_finish)
                due = self._due(slots)
                for ep in due:
                    ep.move(_State.GENERATING)
                if threads is not None:
                    in_flight += [threads.submit(self._act, [ep], sampling) for ep in due]
                elif due:
                    self._act(due, sampling)
        finally:
            bar.close()
            if threads is not None:
                threads.shutdown(wait=True, cancel_futures=True)
            for _, ep in slots.values():  # an exception left episodes open: drop their caches
                self._release(ep)
            self.busy.stop()
            if self.shared is not None:
                self.shared.leave(self.batch)
        return [results[i] for i in range(len(requests))]

    @property
    def _request_per_episode(self) -> bool:
        """A policy behind a server, asynchronously: a request per episode, each from its own thread."""
        return self.mode == "async" and getattr(self.policy, "concurrent_requests", False)

    def _answered(self, slots: dict[int, tuple[int, _Episode]], in_flight: list[Future]) -> list[_Episode]:
        """The episodes whose environments' answers this turn takes. Lockstep: all of them (each
        `recv` waits: a tick waits for the slowest environment). Async: those already in, waiting
        for a first one (or a finished request) until the first waiting episode's gather window
        closes, or for a poll's time; not at all when a generation is due now."""
        stepping, waiting = _in_state(slots, *_IN_ENV), _in_state(slots, _State.WAITING)
        if self.mode == "lockstep":
            return stepping
        until = time.monotonic() + POLL_S
        if waiting:
            until = time.monotonic() if self._due(slots) else min(ep.since for ep in waiting) + self.gather_window_s
        elif any(f.done() for f in in_flight):
            until = time.monotonic()
        while stepping or in_flight:
            ready = [ep for ep in stepping if getattr(self.pool.workers[ep.worker], "ready", lambda: True)()]
            if ready or time.monotonic() >= until or any(f.done() for f in in_flight):
                return ready  # (a worker that cannot say whether it has answered is waited for)
            time.sleep(min(0.002, max(0.0, until - time.monotonic())))
        return []

    def _due(self, slots: dict[int, tuple[int, _Episode]]) -> list[_Episode]:
        """The waiting episodes to generate for now. Lockstep, and a request per episode: all of
        them. Async in this process: once `max_batch` wait, the first has waited the gather
        window, or no answer can come to join them; the longest waiting first, `max_batch` at most."""
        waiting = _in_state(slots, _State.WAITING)
        if self.mode == "lockstep" or self._request_per_episode or not waiting:
            return waiting
        due = (not _in_state(slots, *_IN_ENV) or (self.max_batch and len(waiting) >= self.max_batch)
               or time.monotonic() - min(ep.since for ep in waiting) >= self.gather_window_s)
        return sorted(waiting, key=lambda ep: ep.since)[:self.max_batch or None] if due else []

    # -- internals ---------------------------------------------------------------------------
    def _start_idle(self, queue: deque, slots: dict[int, tuple[int, _Episode]], policy_version: int) -> None:
        """Every idle worker starts the next episode (a reset in flight); one another batch holds
        is not idle (`shared`), and one this batch no longer needs goes back."""
        for w in range(len(self.pool)):
            if w in slots:
                continue
            if not queue:
                if self.shared is not None:
                    self.shared.give(w, self.batch)
                continue
            if self.shared is None or self.shared.take(w, self.batch):
                idx, req = self._next_for(w, queue)
                ep = _Episode(req, w, Trajectory(task=req.task, seed=req.seed, sample=req.sample,
                                                 policy_version=policy_version))
                slots[w] = (idx, ep)
                self._send(ep, _State.RESETTING, (req.task, req.seed))
        if self.shared is not None:
            self.shared.want(self.batch, bool(queue))
        if queue and not slots:  # every worker is another batch's: look again soon
            time.sleep(POLL_S)

    def _leave(self, slots: dict[int, tuple[int, _Episode]], results: dict[int, Trajectory],
               out_dir: str | Path | None, bar: Any, on_finish: Callable[[Trajectory], None] | None) -> None:
        """Finished episodes are written and leave their worker."""
        for w, (idx, ep) in list(slots.items()):
            if ep.state is _State.FINISHED:
                self._release(ep)
                self._finish(ep, out_dir)
                results[idx] = ep.traj
                del slots[w]
                bar.update(1)
                if on_finish:
                    on_finish(ep.traj)

    def _next_for(self, worker: int, queue: deque) -> tuple[int, EpisodeRequest]:
        """Prefer an episode of the task this worker ran last: its environment is still open."""
        last = self._last_task.get(worker)
        for pos, (_, req) in enumerate(queue):
            if req.task == last:
                item = queue[pos]
                del queue[pos]
                return item
        item = queue.popleft()
        self._last_task[worker] = item[1].task
        return item

    def _release(self, ep: _Episode) -> None:
        self.policy.release(id(ep))

    def _send(self, ep: _Episode, to: _State, payload: Any) -> None:
        """Send the worker the reset or the step that moves the episode to `to`."""
        try:
            self.pool.workers[ep.worker].send("reset" if to is _State.RESETTING else "step", payload)
        except EnvError as exc:
            self._env_failure(ep, exc)
            return
        self.busy.env_started(ep.worker)
        ep.move(to)

    def _env_failure(self, ep: _Episode, exc: Exception) -> None:
        ep.traj.status = EpisodeStatus.ENV_ERROR
        ep.traj.error = str(exc)[:2000]
        ep.move(_State.FINISHED)

    def _receive(self, ep: _Episode) -> None:
        """The environment's answer to the reset or step in flight."""
        self.busy.env_stopped(ep.worker)
        try:
            value = self.pool.workers[ep.worker].recv()
        except EnvError as exc:
            self._env_failure(ep, exc)
            return
        if ep.state is _State.RESETTING:
            obs, ep.info = value
            ep.traj.instruction = obs.instruction
            ep.traj.setup_failures = list((ep.info or {}).get("setup_failures") or [])
            if (ep.info or {}).get("setup_skipped"):  # env.on_setup_failure=skip: not played, counted
                ep.traj.status = EpisodeStatus.SETUP_FAILED
                ep.traj.error = "the task's set-up failed: " + "; ".join(ep.traj.setup_failures)[:1900]
                ep.screenshots.append(obs.screenshot)
                ep.move(_State.FINISHED)
                return
            ep.conv = self.policy.new_conversation(obs.instruction)
            self._observe(ep, obs.screenshot)
            return
        obs, reward, terminated, truncated, ep.info = value
        rec = ep.pending_record
        self.env_steps += max(1, len(rec.actions))
        rec.reward, rec.terminated, rec.truncated = float(reward), bool(terminated), bool(truncated)
        rec.seconds = time.monotonic() - ep.since
        rec.action_error = (ep.info or {}).get("action_error")
        ep.traj.steps.append(rec)
        if terminated or truncated or not ep.traj.format_ok:
            # The env scores truncated episodes too: OSWorld's checker judges the final state
            # whatever ended the episode (as OSWorld and ARPO do); MiniWoB gives 0 there.
            ep.traj.task_score = float(reward)
            ep.traj.checker_error = (ep.info or {}).get("checker_error")
            if ep.traj.checker_error:  # training scores it 0; a protocol may leave it to run again
                self._unfinished(ep, self.rules.unfinished(f"the checker raised: {ep.traj.checker_error}"))
            ep.screenshots.append(obs.screenshot)  # the last real screen (the env keeps it)
            ep.move(_State.FINISHED)
        else:
            self._observe(ep, obs.screenshot)

    def _observe(self, ep: _Episode, screenshot: Image.Image) -> None:
        ep.screenshots.append(screenshot)
        ep.conv.add_observation(screenshot)
        ep.move(_State.WAITING)

    def _act(self, eps: list[_Episode], sampling: SamplingParams) -> None:
        """Each episode's next response, parsed and sent to its environment. A response that
        cannot be parsed is sampled again (up to the rules' `parse_attempts` samples, each sampled
        as the rules say) before it ends the episode."""
        with self.busy.generating():
            todo, attempt = eps, 0
            while todo:
                gens = self._generate(todo, self.rules.sampling(sampling, attempt), attempt)
                last_try = attempt + 1 >= self.rules.parse_attempts
                todo = [ep for ep, gen in zip(todo, gens) if not self._take(ep, gen, last_try=last_try)]
                attempt += 1

    def _generate(self, eps: list[_Episode], sampling: SamplingParams, attempt: int) -> list[Any]:
        contexts = [PolicyContext(ep.traj.instruction, ep.screenshots[-1], ep.info, len(ep.traj.steps),
                                  ep.request.task, list(ep.screenshots), [r.response for r in ep.traj.steps])
                    for ep in eps]
        # Each episode samples with its own seed stream: (episode seed, sample, step[, attempt]).
        keys = [(ep.request.seed, ep.request.sample, len(ep.traj.steps)) + ((attempt,) if attempt else ()) for ep in eps]
        seeds = [zlib.crc32(repr(key).encode()) for key in keys]
        # An in-process policy keeps each episode's KV cache between steps under these keys.
        return self.policy.generate([ep.conv.current for ep in eps], sampling=sampling, contexts=contexts,
                                    seeds=seeds, cache_keys=[id(ep) for ep in eps])

    def _take(self, ep: _Episode, gen: Any, last_try: bool) -> bool:
        """Parse one response, record it and step the environment with it; False when it is to
        be sampled again."""
        step = len(ep.traj.steps) + 1
        actions, error, lost = [], None, None
        try:
            parsed = self.policy.parse(gen.text, ep.screenshots[-1].size, rules=self.rules.action_rules)
            actions = action_payload(parsed.actions)
            if not actions:
                raise ActionParseError("no action in the response")
        except ConverterError as exc:  # the response parses: sampling again would not help
            error, lost = exc, self.rules.unfinished(f"the agent raised on the response of step {step}: {exc}")
        except ActionParseError as exc:
            if not last_try:
                ep.discarded.append(gen.text)  # never added to the conversation: the model does not see it
                return False
            error = exc
        if error is None:
            actions = self.rules.actions(actions, step=step, max_steps=self.max_steps, memory=ep.rule_memory)
        ep.conv.add_response(gen.text, gen.token_ids, gen.logprobs)
        record = StepRecord(step, gen.text, [] if error else actions, str(error)[:500] if error else None, 0.0,
                            False, False, 0.0, discarded=ep.discarded, weights_version=_version(gen))
        ep.discarded = []
        if lost is not None:  # lost to the exception: the response is recorded, the environment never stepped
            ep.traj.steps.append(record)
            self._unfinished(ep, lost)
            ep.move(_State.FINISHED)
            return True
        if error is not None:
            # A format failure ends the episode as ARPO does: the environment is stepped with DONE
            # and its checker scores the state the episode reached (a task done before the
            # malformed response still counts); the format penalty comes on top.
            ep.traj.format_ok = False
        ep.pending_record = record
        self._send(ep, _State.STEPPING, DONE if error else actions)
        return True

    @staticmethod
    def _unfinished(ep: _Episode, why: str | None) -> None:
        """Leave the episode without a result when the rules say why (None: they keep it)."""
        if why is not None:
            ep.traj.status = EpisodeStatus.UNFINISHED
            ep.traj.error = why[:2000]

    def _finish(self, ep: _Episode, out_dir: str | Path | None) -> None:
        traj = ep.traj
        traj.seconds = time.monotonic() - ep.started
        if traj.ok:
            traj.reward = trajectory_reward(traj.task_score, traj.format_ok, self.format_coef, self.format_penalty)
            traj.segments = ep.conv.segments if ep.conv else []
        if out_dir is not None:
            domain, _, name = traj.task.rpartition("/")
            directory = safe_join(out_dir, domain or "default", name, str(traj.sample))
            write_trajectory(traj, directory, ep.screenshots)
            if not self.keep_pixels:
                for seg in traj.segments:
                    seg.pixel_values = []
