"""ARPO's training loop: sample tasks, roll out G times each, score, replay, advantages, update.

    for step in range(cfg.train.steps):
        tasks   = task_batch(step)                      # seeded epoch permutations
        trajs   = rollouts(tasks x G)                   # parallel browsers, batched generation
        groups  = per task: replay.maybe_inject(...)    # ARPO: rescue all-failed groups
                  then replay.add(fresh trajectories)
        adv     = estimator(rewards)                    # per group: GRPO's, Bessel std (algo.adv_estimator)
        update  = ARPO's clipped loss (algo.policy_loss), one epoch, `updates_per_batch`
                  optimizer steps (training/update.py)
        metrics -> metrics.jsonl; evaluation and checkpoint (model, optimizer, replay, RNG) when due

The trainer holds the algorithm and reads `train.*` and `algo.*` only; `arpo_lib.build.trainer(cfg)`
gives it the rest: the rollouts (`rollout_source`: this process's model or servers following its
weights), where the update runs (`backend`: one process or FSDP2), the demonstrations (`sft`), the
records (`metrics`), the checkpoints and the evaluation, each deciding its own details and cadence;
the policy update (`update.PolicyUpdate`) holds the optimizer.

Departures from the original, on purpose:
- Infrastructure failures (a crashed browser/VM) are dropped from their group, not scored 0.
- Sequences with advantage exactly 0 are not run through the model (see training/update.py).
- A lone success of a task whose other rollouts hit infrastructure failures is stored for replay
  though its group is too small to train on. A non-finite gradient skips its optimizer step, as
  ARPO; `train.max_skipped_steps` in a row stop the run.
- Checkpoints include the replay buffer and the data order; `resume` continues exactly.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from arpo_lib.algo import ADV_ESTIMATORS, ReplayBuffer
from arpo_lib.algo.grouping import make_groups as group_with_replay
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.store import read_trajectory
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig
from arpo_lib.run.seeding import stable_seed
from arpo_lib.training.backend import TrainingBackend
from arpo_lib.training.checkpoint import Checkpointer
from arpo_lib.training.metrics import RunRecords, staleness_metrics, step_metrics
from arpo_lib.training.rollout_source import RolloutSource, task_batch
from arpo_lib.training.sft import WarmStart, seed_replay_from
from arpo_lib.training.update import NonFiniteGradientError, PolicyUpdate  # noqa: F401 (its old home)
from arpo_lib.training.contracts import TrainablePolicy
from arpo_lib.types import Group, Trajectory

log = logging.getLogger(__name__)


class EvalOutcome(Protocol):
    """What the trainer reads of an evaluation's result (`evaluation.evaluate.EvalResult`, a floor
    above training: named here by what it offers, not imported)."""

    def metrics(self) -> dict[str, Any]: ...


class Evaluator(Protocol):
    """The run's periodic evaluation (`build.evaluator`): when it is due, and an engine's policy
    evaluated with the run's protocol into <run>/eval/<label> (tasks None: the protocol's)."""
    def due(self, step: int) -> bool: ...
    def __call__(self, engine: RolloutEngine, label: str, tasks: list[str] | None = None,
                 spread: Any = None) -> EvalOutcome: ...


class Trainer:
    """Runs ARPO (or GRPO with `algo.replay.enabled=false`) for a `RunConfig`; its collaborators
    come from `arpo_lib.build.trainer` (see the module docstring). `checkpoints` restores the
    checkpoint the run resumes from (its model is already in `policy`); `reference` is the frozen
    model of the KL term (algo.kl_coef > 0); `resume` drops the records after that checkpoint."""

    def __init__(self, cfg: RunConfig, policy: TrainablePolicy, *, rollouts: RolloutSource, backend: TrainingBackend,
                 sft: WarmStart, records: RunRecords, checkpoints: Checkpointer, evaluator: Evaluator,
                 reference: torch.nn.Module | None = None, resume: bool = False):
        self.cfg, self.policy, self.rollouts, self.backend, self.sft = cfg, policy, rollouts, backend, sft
        self.records, self.checkpoints, self.evaluator, self.reference = records, checkpoints, evaluator, reference
        self.run = records.run
        self.run_dir = self.run.root
        t, rp = cfg.train, cfg.algo.replay
        self.updater = PolicyUpdate(cfg, policy, backend, temperature=rollouts.temperature, reference=reference,
                                    checkpoints_dir=self.run.checkpoints)
        self.optimizer, self.scheduler = self.updater.optimizer, self.updater.scheduler
        self.replay: ReplayBuffer[dict[str, Any]] = ReplayBuffer(
            capacity_per_task=rp.capacity_per_task, success_threshold=rp.success_threshold, enabled=rp.enabled,
            seed=stable_seed(t.seed, "replay"), std_threshold=rp.std_threshold, mean_threshold=rp.mean_threshold)
        self.step, self.replay, state = checkpoints.restore(self.optimizer, self.scheduler) or (0, self.replay, {})
        self.weights_version = int(state.get("weights_version", 0))
        """Counts weight changes (warm start, optimizer steps): what a rollout server must hold,
        and how old a replayed trajectory is (checkpointed)."""
        self.updater.consecutive_skips = int(state.get("consecutive_skips", 0))
        self._pending_metrics: dict[str, Any] | None = state.get("pending_metrics")
        self.seconds_warm_start = 0.0
        self._replay_seeded_from = False
        records.start(self.step, resume)

    def close(self, failed: bool = False) -> None:
        """Close the environments, the servers, the tracker and (distributed) the process group;
        `failed`: leave the group without waiting for the other ranks."""
        if failed:  # first: closing the environments can take minutes, and the others may wait for rank 0
            self.backend.stop_weights_pass()
        self.rollouts.close()
        self.records.close()
        self.backend.close(failed)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type: object = None, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    # -- the loop ----------------------------------------------------------------------------------
    def train(self, steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None
              ) -> list[dict[str, Any]]:
        """Run until `cfg.train.steps` rollout batches are done (or `steps` more); returns their
        metrics. `on_step(metrics)` is called after each step (e.g. `workflows.print_step`)."""
        end = self.cfg.train.steps if steps is None else min(self.cfg.train.steps, self.step + steps)
        if self.step == 0:
            self.warm_start()
            self.seed_replay_with_demos()
        history: list[dict[str, Any]] = []
        if (finished := self.finish_pending_step()) is not None:
            history.append(finished)
        with self.records.progress_bar(end, self.step, "ARPO" if self.replay.enabled else "GRPO") as shown:
            while self.step < end:
                history.append(metrics := self.train_step())
                if on_step is not None:
                    on_step(metrics)
                shown(metrics)
        return history

    def train_step(self) -> dict[str, Any]:
        """One rollout batch: roll out, group with replay, update, record; evaluate and checkpoint when due."""
        t0 = time.monotonic()
        t = self.cfg.train
        tasks = task_batch(self.rollouts.tasks, self.step, t.tasks_per_batch, t.seed)
        if self.rollouts.max_staleness:  # the next batches play on the servers from now on: on the
            # environments this batch no longer needs, then while its update runs
            self.rollouts.run_ahead(self.step, self.weights_version, t.steps,
                                    lambda s: task_batch(self.rollouts.tasks, s, t.tasks_per_batch, t.seed))
        trajs, env_steps = self.rollouts.sample(tasks, self.step, self.weights_version)
        t_rollout = time.monotonic() - t0

        groups = self.make_groups(tasks, trajs)
        self.records.groups(self.step, groups)
        staleness = staleness_metrics(trajs, self.weights_version) if self.rollouts.max_staleness else {}
        t1 = time.monotonic()
        update = self.update(groups)
        self.rollouts.weights_changed(self.weights_version)
        t_update = time.monotonic() - t1
        self.step += 1

        metrics = step_metrics(self.step, tasks, trajs, groups, replay_size=len(self.replay), env_steps=env_steps,
                               lr=self.scheduler.get_last_lr()[0], update=update, seconds_rollout=t_rollout,
                               seconds_update=t_update, extra={**self.rollouts.metrics(), **staleness})
        if not self.evaluator.due(self.step):
            self.records.log(metrics)
            if self.checkpoints.due(self.step):
                self.save_checkpoint()
            return metrics
        # An evaluation can take hours (the final one: every task): the step's checkpoint comes
        # first, holding the step's metrics, so a run that dies evaluating resumes at the
        # evaluation, not at the update before it (`finish_pending_step`).
        if self.checkpoints.due(self.step):
            self.save_checkpoint(pending_metrics=metrics)
        return self.evaluate_and_log(metrics)

    def evaluate_and_log(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's evaluation, its figures added to the step's metrics, which are then logged.
        Distributed, every rank plays its share on its own environments; rank 0 writes the result."""
        self.rollouts.wait_ahead()  # the evaluation takes the environments
        spread = self.backend if self.backend.ranks.distributed else None
        metrics = {**metrics, **self.evaluate(layout.step_name(self.step), spread=spread).metrics()}
        self.records.log(metrics)
        return metrics

    def finish_pending_step(self) -> dict[str, Any] | None:
        """A run resumed from a checkpoint written before its step's evaluation that never logged
        the step: evaluate now and log the step's metrics (None when nothing was pending)."""
        pending, self._pending_metrics = self._pending_metrics, None
        if pending is None or self.records.logged(self.step):
            return None
        log.info("step %d was checkpointed before its evaluation: evaluating now", self.step)
        return self.evaluate_and_log(pending)

    def make_groups(self, tasks: list[str], trajs: list[Trajectory]) -> list[Group]:
        """Per task: drop infrastructure failures, inject a replayed success into all-failed groups
        (ARPO), store fresh successes, compute advantages (`algo.grouping.make_groups`). A replayed
        trajectory is read with its tokens only: the update encodes its screenshots, one
        micro-batch at a time, as it does every trajectory's."""
        estimator, algo = ADV_ESTIMATORS[self.cfg.algo.adv_estimator], self.cfg.algo
        return group_with_replay(tasks, trajs, self.replay, load=lambda d: read_trajectory(d, tokens=True).trajectory,
                           advantages=lambda r: estimator(torch.tensor(r, dtype=torch.float64), algo).tolist())

    def update(self, groups: list[Group]) -> dict[str, Any]:
        """The policy update (`training/update.py`): one PPO epoch, `updates_per_batch` optimizer steps."""
        stats = self.updater(groups, self.step, self.weights_version)
        self.weights_version += stats["optimizer_steps"]
        return stats

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row for a non-finite gradient (train.max_skipped_steps)."""
        return self.updater.consecutive_skips

    # -- before the first step, evaluation and checkpoints -----------------------------------------
    def warm_start(self) -> list[float]:
        """Supervised warm start before the first step (once; a resumed run has it in its weights)."""
        t0 = time.monotonic()
        losses = self.sft.warm_start() if self.step == 0 else None
        if losses is None:  # not asked for, or done
            return []
        self.weights_version += 1
        self.seconds_warm_start = time.monotonic() - t0
        return losses

    def seed_replay_with_demos(self) -> int:
        """Put `train.demo_replay` scripted demonstrations per task, and the stored successes under
        `algo.replay.seed_from`, into the replay buffer (once, before the first step; they are
        saved with the buffer). Returns how many were stored."""
        if self.step != 0 or not self.replay.enabled:
            return 0
        stored = self.sft.seed_replay(self.replay)
        seed_from = self.cfg.algo.replay.seed_from
        if seed_from and not self._replay_seeded_from:
            self._replay_seeded_from = True
            stored += seed_replay_from(self.replay, seed_from, self.rollouts.tasks)
        return stored

    def evaluate(self, label: str, tasks: list[str] | None = None, spread: Any = None) -> EvalOutcome:
        """Evaluate the current policy with the run's protocol into <run>/eval/<label> (an
        `evaluation.evaluate.EvalResult`); `spread`: every rank together, each playing its share
        (`evaluation.evaluate.Spread`: the backend), the servers brought up to date together."""
        engine = self.rollouts.engine(self.weights_version, announce=spread is not None)
        return self.evaluator(engine, label, tasks, spread=spread)

    def save_checkpoint(self, pending_metrics: dict[str, Any] | None = None) -> Path:
        """Write this step's checkpoint (distributed: every rank calls this); `pending_metrics`:
        the step's metrics when its evaluation, and so its metric line, comes after."""
        state = {"consecutive_skips": self.consecutive_skips, "weights_version": self.weights_version}
        if pending_metrics is not None:
            state["pending_metrics"] = pending_metrics
        return self.checkpoints.save(self.step, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                                     replay=self.replay, config=self.cfg.to_dict(), state=state)

