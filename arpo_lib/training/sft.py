"""Supervised warm start on scripted demonstrations (UI-TARS itself is SFT'd before RL).

The demonstrations are real trajectories from `ScriptedPolicy` through the normal rollout path,
so their tokens are exactly what the policy would have to sample. The loss is the mean negative
log-likelihood of the assistant tokens, computed with the same `sequence_logprobs` the RL
update uses. `WarmStart` is what a trainer does with them before its first step: collect them
once, warm-start on them, seed the replay buffer with them (`warm_start.*`, `train.demo_replay`),
and `seed_replay_from`: the buffer seeded with stored successes of the policy itself (e.g. the
ones task selection found, `algo.replay.seed_from`).
"""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from arpo_lib.agent.scripted import SCRIPTED_TASKS, ScriptedPolicy, supports
from arpo_lib.algo import ReplayBuffer, replay_item
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import append_jsonl
from arpo_lib.types import Trajectory, WorkerPool, episode_requests
from arpo_lib.training.contracts import TrainablePolicy

if TYPE_CHECKING:
    from arpo_lib.training.backend import TrainingBackend

log = logging.getLogger(__name__)


def collect_demonstrations(policy: TrainablePolicy, pool: WorkerPool, tasks: Sequence[str], per_task: int, *, seed: int,
                           out_dir: Path | None = None, max_steps: int = 15, progress: bool = True) -> list[Trajectory]:
    """Run the scripted demonstrator `per_task` times per supported task; returns the successes.

    Demonstrations are drawn on fresh layouts of a task's family, never on the fixed instances
    being trained (`miniwob/click-test@3` -> demonstrations of `miniwob/click-test`): the warm
    start must not have seen the screens RL is measured on (UI-TARS's SFT data is not OSWorld's)."""
    from arpo_lib.envs import split_instance

    bases = list(dict.fromkeys(split_instance(t)[0] for t in tasks))
    supported = [t for t in bases if supports(t)]
    if not supported:
        raise ValueError(f"no scripted demonstrator for any of {list(tasks)}; supported: the desktop suite "
                         f"and miniwob/{{{', '.join(SCRIPTED_TASKS)}}}")
    engine = RolloutEngine(ScriptedPolicy(policy), pool, max_steps=max_steps)
    requests = episode_requests(supported, per_task, seed, "demo")
    trajs = engine.run(requests, out_dir=out_dir, progress=progress, description="demonstrations")
    return [t for t in trajs if t.success]


def first_per_task(trajs: Sequence[Trajectory], n: int) -> list[Trajectory]:
    """The first `n` trajectories of each task, in order (the demonstrations a run uses)."""
    counts: dict[str, int] = {}
    chosen = []
    for t in trajs:
        if counts.get(t.task, 0) < n:
            counts[t.task] = counts.get(t.task, 0) + 1
            chosen.append(t)
    return chosen


def supervised_warm_start(policy: TrainablePolicy, demos: Sequence[Trajectory], *, steps: int, lr: float = 1e-3,
                          batch_size: int = 4, seed: int = 0, progress: bool = True) -> list[float]:
    """AdamW on the demonstrations' assistant tokens for `steps` steps; returns the loss per step."""
    from tqdm.auto import tqdm

    segments = [s for t in demos for s in t.segments if any(s.loss_mask)]
    if not segments:
        raise ValueError("no demonstration segments to train on")
    rng = random.Random(seed)
    params = policy.trainable_parameters()  # all weights, or only the LoRA adapters
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.model.train()
    losses = []
    for _ in tqdm(range(steps), desc="warm start", disable=not progress, leave=False):
        batch = rng.sample(segments, min(batch_size, len(segments)))
        logprobs = policy.sequence_logprobs(batch, temperature=1.0)
        loss = -torch.cat(logprobs).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
    policy.model.eval()
    return losses


def warm_start(policy: TrainablePolicy, demos: Sequence[Trajectory], *, per_task: int, steps: int, lr: float,
               batch_size: int, seed: int, record: Path | None, progress: bool = True) -> list[float]:
    """The run's warm start: `supervised_warm_start` on the first `per_task` demonstrations of
    each task, recorded in `record` (warm_start.jsonl) and logged."""
    chosen = first_per_task(demos, per_task)
    losses = supervised_warm_start(policy, chosen, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                                   progress=progress)
    if record is not None:  # None: a distributed run's other ranks (rank 0 records)
        append_jsonl(record, {"demos": len(chosen), "steps": steps, "loss_first": losses[0], "loss_last": losses[-1]})
    log.info("warm start: %d SFT steps on %d demonstrations, loss %.3f -> %.3f", steps, len(chosen), losses[0],
             losses[-1])
    return losses


def seed_replay(replay: ReplayBuffer, demos: Sequence[Trajectory], per_task: int, tasks: Sequence[str]) -> int:
    """Store the first `per_task` demonstrations of each task in the replay buffer; returns how many."""
    chosen = first_per_task(demos, per_task)
    stored = sum(replay.add(t.task, replay_item(t.directory, t.task_score, t.reward), t.task_score) for t in chosen)
    missing = sorted(set(tasks) - {t.task for t in chosen})
    if missing:
        log.info("no demonstrations for %s; their replay starts empty", missing)
    log.info("replay buffer seeded with %d scripted demonstrations", stored)
    return stored


def seed_replay_from(replay: ReplayBuffer, directory: str | Path, tasks: Sequence[str]) -> int:
    """Store the successes among the trajectory directories under `directory` (any depth, in path
    order) whose task is one of `tasks`; returns how many were stored. FileNotFoundError when
    `directory` is not a directory: a seeded arm must not quietly start empty."""
    from arpo_lib.rollout.store import read_trajectory
    from arpo_lib.run import layout

    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"algo.replay.seed_from: {root} is not a directory (a task selection keeps its "
                                "episodes' trajectories with select.save_trajectories=true)")
    wanted, stored, per_task = set(tasks), 0, {}
    for meta in sorted(root.rglob(layout.META)):
        traj = read_trajectory(meta.parent).trajectory
        if traj.task in wanted and traj.ok and replay.add(traj.task, replay_item(traj.directory, traj.task_score, traj.reward), traj.task_score):
            stored += 1
            per_task[traj.task] = per_task.get(traj.task, 0) + 1
    log.info("replay buffer seeded with %d stored successes from %s (%s)", stored, root,
             ", ".join(f"{t}: {n}" for t, n in sorted(per_task.items())) or "no task of this run")
    return stored


class WarmStart:
    """A trainer's demonstrations: collected once (`max(demos_per_task, demo_replay)` successes per
    supported task, into <run>/demos), the supervised warm start on the first `demos_per_task` of
    each task, and the replay buffer seeded with the first `demo_replay`, each once (`done`: a run
    resumed from a checkpoint has both). Distributed: rank 0 collects and trains, every rank gets
    the demonstrations and the weights (`backend`)."""

    def __init__(self, policy: TrainablePolicy, backend: "TrainingBackend", pool: Callable[[], WorkerPool], *,
                 run: RunDir, tasks: Sequence[str], demos_per_task: int, steps: int, lr: float, batch_size: int,
                 demo_replay: int, seed: int, max_steps: int, progress: bool, done: bool = False):
        self.policy, self.backend, self.pool, self.run = policy, backend, pool, run
        self.tasks, self.demos_per_task, self.steps = tasks, demos_per_task, steps
        self.lr, self.batch_size = lr, batch_size
        self.demo_replay, self.seed, self.max_steps, self.progress = demo_replay, seed, max_steps, progress
        self.warm_started = self.replay_seeded = done
        self._demos: list[Trajectory] | None = None

    def demonstrations(self) -> list[Trajectory]:
        """The successful scripted demonstrations (collected on the first call)."""
        if self._demos is None:
            n = max(self.demos_per_task, self.demo_replay)
            demos = self.backend.on_main(lambda: collect_demonstrations(
                self.policy, self.pool(), self.tasks, n, seed=self.seed, out_dir=self.run.demos,
                max_steps=self.max_steps, progress=self.progress) if n > 0 else [])
            self._demos = self.backend.broadcast(demos)
        return self._demos

    def warm_start(self) -> list[float] | None:
        """The warm start (rank 0 trains the full model, then every rank gets it); its losses (none
        on the other ranks). None when there is none (warm_start.steps=0) or it was done."""
        if self.steps <= 0 or self.warm_started:
            return None
        demos = self.demonstrations()
        # rank 0 alone, for as long as it takes; the others wait on the control group (gloo, its
        # long timeout) and raise at once if it fails, before anyone posts the weights' broadcast
        losses = self.backend.on_main(lambda: warm_start(
            self.policy, demos, per_task=self.demos_per_task, steps=self.steps, lr=self.lr,
            batch_size=self.batch_size, seed=self.seed, record=self.run.warm_start_log,
            progress=self.progress)) or []
        self.backend.after_warm_start()
        self.warm_started = True
        return losses

    def seed_replay(self, replay: ReplayBuffer) -> int:
        """Store `demo_replay` demonstrations per task in `replay` (once); returns how many."""
        if self.demo_replay <= 0 or self.replay_seeded:
            return 0
        self.replay_seeded = True
        return seed_replay(replay, self.demonstrations(), self.demo_replay, self.tasks)
