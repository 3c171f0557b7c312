"""Rollouts: run many episodes over a pool of environment workers, batching model calls.

Each tick sends every waiting environment its command (reset or step) so the browsers work in
parallel, collects the answers, then asks the policy for the next action of every live episode
in ONE batched generate call. Episodes are written in OSWorld's result layout:

    <dir>/step_0.png ... step_N.png   screenshots the model saw (step_0 = after reset)
    <dir>/traj.jsonl                  one line per step: response, parsed actions, reward, done,
                                      the environment's action error, responses resampled away
    <dir>/result.txt                  the task score (none for an unfinished episode: OSWorld's
                                      mark of an example still to run)
    <dir>/meta.json                   task, seed, instruction, scores, status
    <dir>/tokens.pt                   token ids, loss mask and behaviour log-probs per segment

A trajectory can be reloaded for training from that directory alone (the replay buffer keeps
only the path).
"""
from __future__ import annotations

import io
import json
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from arpo_lib.actions import FINAL_KINDS, Action, ActionParseError, ConverterError
from arpo_lib.agent.prompt import Segment, TokenConversation
from arpo_lib.algo import trajectory_reward
from arpo_lib.envs.base import EnvError
from arpo_lib.envs.worker import action_payload
from arpo_lib.run import layout
from arpo_lib.run.records import atomic_write_bytes, safe_join
from arpo_lib.types import (EpisodeRequest, EpisodeStatus, Policy, PolicyContext, StepRecord, Trajectory,
                            WorkerPool)


# ----------------------------------------------------------------------------- storage

def save_trajectory(traj: Trajectory, directory: Path, screenshots: Sequence[Image.Image]) -> None:
    """Write a trajectory in the OSWorld layout plus tokens.pt and meta.json."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, shot in enumerate(screenshots):
        shot.save(directory / layout.screenshot_name(i))
    lines = []
    for rec in traj.steps:
        lines.append(json.dumps({
            "step_num": rec.step, "response": rec.response, "action": rec.actions,
            "parse_error": rec.parse_error, "reward": rec.reward, "done": rec.terminated or rec.truncated,
            "truncated": rec.truncated, "screenshot_file": layout.screenshot_name(rec.step), "seconds": round(rec.seconds, 3),
            "action_error": rec.action_error, "discarded_responses": rec.discarded,
        }))
    (directory / layout.STEPS).write_text("\n".join(lines) + ("\n" if lines else ""))
    result = directory / layout.RESULT
    if traj.status == EpisodeStatus.UNFINISHED:
        result.unlink(missing_ok=True)  # no score: the example is still to run
    else:
        result.write_text(f"{traj.task_score}\n")
    buf = io.BytesIO()
    torch.save([s.token_data() for s in traj.segments], buf)
    atomic_write_bytes(directory / layout.TOKENS, buf.getvalue())
    # meta.json last: its presence marks a complete trajectory directory.
    atomic_write_bytes(directory / layout.META, json.dumps(traj.summary(), indent=1).encode())
    traj.directory = str(directory)


def load_trajectory(directory: str | Path, processor: Any) -> Trajectory:
    """Rebuild a trajectory (with model-ready segments) from its directory."""
    directory = Path(directory)
    meta_path = directory / layout.META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete trajectory directory (no meta.json)")
    meta = json.loads(meta_path.read_text())
    traj = Trajectory(task=meta["task"], seed=meta["seed"], sample=meta["sample"], instruction=meta["instruction"],
                      task_score=meta["task_score"], format_ok=meta["format_ok"], reward=meta["reward"],
                      status=EpisodeStatus(meta["status"]), error=meta.get("error"), directory=str(directory),
                      policy_version=int(meta.get("policy_version", 0)), checker_error=meta.get("checker_error"))
    for line in (directory / layout.STEPS).read_text().splitlines():
        rec = json.loads(line)
        traj.steps.append(StepRecord(step=rec["step_num"], response=rec["response"], actions=rec["action"],
                                     parse_error=rec["parse_error"], reward=rec["reward"],
                                     terminated=rec["done"] and not rec.get("truncated", False),
                                     truncated=rec.get("truncated", False), seconds=rec.get("seconds", 0.0),
                                     action_error=rec.get("action_error"), discarded=rec.get("discarded_responses", [])))
    for data in torch.load(directory / layout.TOKENS):
        seg = Segment(input_ids=data["input_ids"], mm_token_type_ids=data["mm_token_type_ids"],
                      loss_mask=data["loss_mask"], behaviour_logprobs=data["behaviour_logprobs"],
                      screenshot_steps=data["screenshot_steps"])
        if seg.screenshot_steps:
            images = [Image.open(directory / layout.screenshot_name(i)).convert("RGB") for i in seg.screenshot_steps]
            enc = processor.image_processor(images=images, return_tensors="pt")
            sizes = [int(torch.prod(g)) for g in enc["image_grid_thw"]]
            seg.pixel_values = list(torch.split(enc["pixel_values"], sizes))
            seg.image_grid_thw = list(enc["image_grid_thw"])
        traj.segments.append(seg)
    return traj


# ----------------------------------------------------------------------------- the engine

DONE = action_payload([Action("finished")])
"""What a malformed response sends the environment: end the episode (OSWorld's DONE)."""


@dataclass
class _Episode:
    request: EpisodeRequest
    worker: int
    traj: Trajectory
    conv: TokenConversation | None = None
    screenshots: list[Image.Image] = field(default_factory=list)
    pending: str | None = None
    """`reset` or `step` while a worker command is in flight."""
    pending_record: StepRecord | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """The environment's last info dict (scripted policies read `dom_elements` from it)."""
    started: float = 0.0
    step_started: float = 0.0
    done: bool = False
    call_user_waits: int = 0
    """call_user actions answered with WAIT so far (an evaluation protocol's rule)."""
    discarded: list[str] = field(default_factory=list)
    """This step's responses sampled again because they could not be parsed."""


class RolloutEngine:
    """Runs episodes of a policy over an `EnvPool`."""

    def __init__(self, policy: Policy, pool: WorkerPool, *, max_steps: int = 15, format_coef: float = 0.5,
                 format_penalty: float = -1.0, frequency_penalty: float = 0.0, fail_at_last_step: bool = False,
                 call_user_waits: int = 0, action_rules: str = "workbench", max_new_tokens: int | None = None,
                 parse_attempts: int = 1, retry_temperature: float = 1.0, unfinished_on_error: bool = False):
        """`frequency_penalty`, `fail_at_last_step`, `call_user_waits`, `action_rules`,
        `max_new_tokens`, `parse_attempts`, `retry_temperature`, `unfinished_on_error`: an evaluation
        protocol's rules (`evaluation.protocols.EvalProtocol` says what each does); training uses
        none of them."""
        if parse_attempts < 1:
            raise ValueError(f"parse_attempts must be >= 1, got {parse_attempts}")
        self.policy = policy
        self.pool = pool
        self.max_steps = max_steps
        self.format_coef = format_coef
        self.format_penalty = format_penalty
        self.frequency_penalty = frequency_penalty
        self.fail_at_last_step = fail_at_last_step
        self.call_user_waits = call_user_waits
        self.action_rules = action_rules
        self.max_new_tokens = max_new_tokens
        self.parse_attempts = parse_attempts
        self.retry_temperature = retry_temperature
        self.unfinished_on_error = unfinished_on_error
        self.env_steps = 0
        self._last_task: dict[int, str] = {}

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
        `policy_version` (the trainer's weight version, for the age of replayed data)."""
        from tqdm.auto import tqdm

        queue = deque(enumerate(requests))
        results: dict[int, Trajectory] = {}
        slots: dict[int, tuple[int, _Episode]] = {}
        bar = tqdm(total=len(requests), desc=description, disable=not progress, leave=False)
        try:
            while queue or slots:
                # 1. every idle worker starts the next episode
                for w in range(len(self.pool)):
                    if w not in slots and queue:
                        idx, req = self._next_for(w, queue)
                        ep = _Episode(req, w, Trajectory(task=req.task, seed=req.seed, sample=req.sample,
                                                         policy_version=policy_version), started=time.monotonic())
                        slots[w] = (idx, ep)
                        self._send(ep, "reset", (req.task, req.seed))
                # 2. collect the answers (the environments worked in parallel meanwhile)
                for w, (idx, ep) in list(slots.items()):
                    if ep.pending:
                        self._receive(ep)
                # 3. finished episodes leave; the rest get their next action in one batch
                for w, (idx, ep) in list(slots.items()):
                    if ep.done:
                        self._release(ep)
                        self._finish(ep, out_dir)
                        results[idx] = ep.traj
                        del slots[w]
                        bar.update(1)
                        if on_finish:
                            on_finish(ep.traj)
                live = [ep for _, ep in slots.values() if not ep.pending and not ep.done]
                if live:
                    self._act(live, temperature, top_p)
        finally:
            bar.close()
            for _, ep in slots.values():  # an exception left episodes open: drop their caches
                self._release(ep)
        return [results[i] for i in range(len(requests))]

    # -- internals ---------------------------------------------------------------------------
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

    def _send(self, ep: _Episode, cmd: str, payload: Any) -> None:
        try:
            self.pool.workers[ep.worker].send(cmd, payload)
            ep.pending = cmd
            ep.step_started = time.monotonic()
        except EnvError as exc:
            self._env_failure(ep, exc)

    def _env_failure(self, ep: _Episode, exc: Exception) -> None:
        ep.traj.status = EpisodeStatus.ENV_ERROR
        ep.traj.error = str(exc)[:2000]
        ep.pending = None
        ep.done = True

    def _receive(self, ep: _Episode) -> None:
        cmd, ep.pending = ep.pending, None
        try:
            value = self.pool.workers[ep.worker].recv()
        except EnvError as exc:
            self._env_failure(ep, exc)
            return
        if cmd == "reset":
            obs, ep.info = value
            ep.traj.instruction = obs.instruction
            ep.conv = self.policy.new_conversation(obs.instruction)
            self._observe(ep, obs.screenshot)
            return
        obs, reward, terminated, truncated, ep.info = value
        self.env_steps += max(1, len(ep.pending_record.actions)) if ep.pending_record else 1
        rec = ep.pending_record
        rec.reward, rec.terminated, rec.truncated = float(reward), bool(terminated), bool(truncated)
        rec.seconds = time.monotonic() - ep.step_started
        rec.action_error = (ep.info or {}).get("action_error")
        ep.traj.steps.append(rec)
        if terminated or truncated or not ep.traj.format_ok:
            # The env scores truncated episodes too: OSWorld's checker judges the final state
            # whatever ended the episode (as OSWorld and ARPO do); MiniWoB gives 0 there.
            ep.traj.task_score = float(reward)
            ep.traj.checker_error = (ep.info or {}).get("checker_error")
            if ep.traj.checker_error and self.unfinished_on_error:
                # The fork's runner: evaluate() raised, so no result is written and its next pass
                # runs the example again. (ARPO's training, and ours: a score of 0.)
                self._unfinished(ep, f"the checker raised: {ep.traj.checker_error}")
            ep.done = True
            ep.screenshots.append(obs.screenshot)  # the last real screen (the env keeps it)
        else:
            self._observe(ep, obs.screenshot)

    def _observe(self, ep: _Episode, screenshot: Image.Image) -> None:
        ep.screenshots.append(screenshot)
        ep.conv.add_observation(screenshot)

    def _act(self, live: list[_Episode], temperature: float, top_p: float) -> None:
        """Every live episode's next response, parsed and sent to its environment. A response that
        cannot be parsed is sampled again (up to `parse_attempts` samples, the later ones at
        `retry_temperature`, as the OSWorld fork's agent does) before it ends the episode."""
        todo, attempt = live, 0
        while todo:
            gens = self._generate(todo, temperature if attempt == 0 else self.retry_temperature, top_p, attempt)
            todo = [ep for ep, gen in zip(todo, gens) if not self._take(ep, gen, last_try=attempt + 1 >= self.parse_attempts)]
            attempt += 1

    def _generate(self, eps: list[_Episode], temperature: float, top_p: float, attempt: int) -> list[Any]:
        contexts = [PolicyContext(ep.traj.instruction, ep.screenshots[-1], ep.info, len(ep.traj.steps),
                                  ep.request.task, list(ep.screenshots), [r.response for r in ep.traj.steps])
                    for ep in eps]
        # Each episode samples with its own seed stream: (episode seed, sample, step[, attempt]).
        keys = [(ep.request.seed, ep.request.sample, len(ep.traj.steps)) + ((attempt,) if attempt else ()) for ep in eps]
        seeds = [zlib.crc32(repr(key).encode()) for key in keys]
        # An in-process policy keeps each episode's KV cache between steps under these keys.
        extra: dict[str, Any] = {"frequency_penalty": self.frequency_penalty} if self.frequency_penalty else {}
        if self.max_new_tokens:
            extra["max_new_tokens"] = self.max_new_tokens
        return self.policy.generate([ep.conv.current for ep in eps], temperature=temperature, top_p=top_p,
                                    contexts=contexts, seeds=seeds, cache_keys=[id(ep) for ep in eps], **extra)

    def _take(self, ep: _Episode, gen: Any, last_try: bool) -> bool:
        """Parse one response and step its environment; False when it is to be sampled again."""
        step = len(ep.traj.steps) + 1
        try:
            parsed = self.policy.parse(gen.text, ep.screenshots[-1].size, rules=self.action_rules)
            actions = action_payload(parsed.actions)
            if not actions:
                raise ActionParseError("no action in the response")
        except ConverterError as exc:
            if not self.unfinished_on_error:
                return self._format_failure(ep, gen, step, exc)
            # The fork's agent raises outside its resample loop; its runner writes no result.
            ep.conv.add_response(gen.text, gen.token_ids, gen.logprobs)
            ep.traj.steps.append(StepRecord(step, gen.text, [], str(exc)[:500], 0.0, False, False, 0.0,
                                            discarded=ep.discarded))
            ep.discarded = []
            self._unfinished(ep, f"the agent raised on the response of step {step}: {exc}")
            ep.done = True
            return True
        except ActionParseError as exc:
            if not last_try:
                ep.discarded.append(gen.text)  # never added to the conversation: the model does not see it
                return False
            return self._format_failure(ep, gen, step, exc)
        ep.conv.add_response(gen.text, gen.token_ids, gen.logprobs)
        actions = self._protocol_rules(ep, step, actions)
        ep.pending_record = StepRecord(step, gen.text, actions, None, 0.0, False, False, 0.0, discarded=ep.discarded)
        ep.discarded = []
        self._send(ep, "step", actions)
        return True

    def _format_failure(self, ep: _Episode, gen: Any, step: int, exc: Exception) -> bool:
        # A format failure ends the episode as ARPO does: the environment is stepped with DONE and
        # its checker scores the state the episode reached (a task done before the malformed
        # response still counts); the format penalty comes on top.
        ep.conv.add_response(gen.text, gen.token_ids, gen.logprobs)
        ep.traj.format_ok = False
        ep.pending_record = StepRecord(step, gen.text, [], str(exc)[:500], 0.0, False, False, 0.0, discarded=ep.discarded)
        ep.discarded = []
        self._send(ep, "step", DONE)
        return True

    @staticmethod
    def _unfinished(ep: _Episode, why: str) -> None:
        ep.traj.status = EpisodeStatus.UNFINISHED
        ep.traj.error = (why + " (the OSWorld fork's runner writes no result for it and runs it again "
                         "on its next pass)")[:2000]

    def _protocol_rules(self, ep: _Episode, step: int, actions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An evaluation protocol's replacements (the OSWorld fork's UI-TARS agent): call_user
        answered with WAIT a few times, and a non-final last action turned into FAIL."""
        kinds = [a["kind"] for a in actions]
        if self.call_user_waits and "call_user" in kinds and ep.call_user_waits < self.call_user_waits:
            ep.call_user_waits += 1
            return action_payload([Action("wait", rules=self.action_rules)])
        final = any(k in FINAL_KINDS for k in kinds)
        if self.fail_at_last_step and step >= self.max_steps and not final:
            return action_payload([Action("call_user", rules=self.action_rules)])  # OSWorld's FAIL
        return actions

    def _finish(self, ep: _Episode, out_dir: str | Path | None) -> None:
        traj = ep.traj
        traj.seconds = time.monotonic() - ep.started
        if traj.ok:
            traj.reward = trajectory_reward(traj.task_score, traj.format_ok, self.format_coef, self.format_penalty)
            traj.segments = ep.conv.segments if ep.conv else []
        if out_dir is not None:
            domain, _, name = traj.task.rpartition("/")
            directory = safe_join(out_dir, domain or "default", name, str(traj.sample))
            save_trajectory(traj, directory, ep.screenshots)
