"""ARPO's training loop: sample tasks, roll out G times each, score, replay, advantages, update.

    for step in range(cfg.train.steps):
        tasks   = task_batch(step)                      # seeded epoch permutations
        trajs   = rollouts(tasks x G)                   # parallel browsers, batched generation
        groups  = per task: replay.maybe_inject(...)    # ARPO: rescue all-failed groups
                  then replay.add(fresh trajectories)
        adv     = estimator(rewards)                    # per group: GRPO's, Bessel std (algo.adv_estimator)
        update  = ARPO's clipped loss (algo.policy_loss), one epoch, `updates_per_batch` optimizer steps
        metrics -> metrics.jsonl; evaluation and checkpoint (model, optimizer, replay, RNG) when due

The trainer holds the algorithm and reads `train.*` and `algo.*` only; `arpo_lib.build.trainer(cfg)`
gives it the rest: the rollouts (`rollout_source`: this process's model or servers following its
weights), where the update runs (`backend`: one process or FSDP2), the demonstrations (`sft`), the
records (`metrics`), the checkpoints and the evaluation, each deciding its own details and cadence.

Departures from the original, on purpose:
- Infrastructure failures (a crashed browser/VM) are dropped from their group, not scored 0.
- Sequences with advantage exactly 0 are counted in the loss normaliser but not run through the
  model (their loss and gradient are exactly zero), unless a KL term (algo.kl_coef) needs them.
- A lone success of a task whose other rollouts hit infrastructure failures is stored for replay
  though its group is too small to train on. A non-finite gradient skips its optimizer step, as
  ARPO; `train.max_skipped_steps` in a row stop the run.
- `algo.old_logprobs=recompute` (default, as ARPO) recomputes old log-probs with the current
  policy before the update; `behaviour` uses the log-probs stored at sampling time instead.
- Checkpoints include the replay buffer and the data order; `resume` continues exactly.
"""
from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from arpo_lib.algo import ADV_ESTIMATORS, POLICY_LOSSES, ReplayBuffer, truncated_is_weights
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.store import load_trajectory
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig
from arpo_lib.run.seeding import stable_seed
from arpo_lib.training.backend import Plan, TrainingBackend
from arpo_lib.training.checkpoint import Checkpointer
from arpo_lib.training.metrics import RunRecords, UpdateMetrics, is_weight_stats, step_metrics
from arpo_lib.training.optim import make_optimizer, warmup_schedule
from arpo_lib.training.rollout_source import RolloutSource, task_batch
from arpo_lib.training.sft import WarmStart
from arpo_lib.types import Group, TrainablePolicy, Trajectory

if TYPE_CHECKING:  # annotations only: evaluation sits above training
    from arpo_lib.evaluation.evaluate import EvalResult

log = logging.getLogger(__name__)


class NonFiniteGradientError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite gradient (train.max_skipped_steps)."""


class Evaluator(Protocol):
    """The run's periodic evaluation (`build.evaluator`): when it is due, and an engine's policy
    evaluated with the run's protocol into <run>/eval/<label> (tasks None: the protocol's)."""
    def due(self, step: int) -> bool: ...
    def __call__(self, engine: RolloutEngine, label: str, tasks: list[str] | None = None) -> EvalResult: ...


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
        self.optimizer = make_optimizer(t.optimizer, backend.parameters(), t.lr, t.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, t.steps * t.updates_per_batch, t.warmup_ratio,
                                         t.lr_schedule, t.min_lr_ratio)
        self.replay: ReplayBuffer[dict[str, Any]] = ReplayBuffer(
            capacity_per_task=rp.capacity_per_task, success_threshold=rp.success_threshold, enabled=rp.enabled,
            seed=stable_seed(t.seed, "replay"), std_threshold=rp.std_threshold, mean_threshold=rp.mean_threshold)
        self.step, self.replay, state = checkpoints.restore(self.optimizer, self.scheduler) or (0, self.replay, {})
        self.weights_version = int(state.get("weights_version", 0))
        """Counts weight changes (warm start, optimizer steps): what a rollout server must hold,
        and how old a replayed trajectory is (checkpointed)."""
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        """Optimizer steps skipped in a row for a non-finite gradient (train.max_skipped_steps)."""
        self.seconds_warm_start = 0.0
        records.start(self.step, resume)

    def close(self, failed: bool = False) -> None:
        """Close the environments, the servers, the tracker and (distributed) the process group;
        `failed`: leave the group without waiting for the other ranks."""
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
        tasks = task_batch(self.rollouts.tasks, self.step, self.cfg.train.tasks_per_batch, self.cfg.train.seed)
        trajs, env_steps = self.rollouts.sample(tasks, self.step, self.weights_version)
        t_rollout = time.monotonic() - t0

        groups = self.make_groups(tasks, trajs)
        self.records.groups(self.step, groups)
        t1 = time.monotonic()
        update = self.update(groups)
        self.rollouts.weights_changed(self.weights_version)
        t_update = time.monotonic() - t1
        self.step += 1

        evaluation = {}
        if self.evaluator.due(self.step):  # rank 0's, the others wait
            evaluation = self.backend.on_main(lambda: self.evaluate(layout.step_name(self.step)).metrics()) or {}
        metrics = step_metrics(self.step, tasks, trajs, groups, replay_size=len(self.replay), env_steps=env_steps,
                               lr=self.scheduler.get_last_lr()[0], update=update, seconds_rollout=t_rollout,
                               seconds_update=t_update, extra={**self.rollouts.metrics(), **evaluation})
        self.records.log(metrics)
        if self.checkpoints.due(self.step):
            self.save_checkpoint()
        return metrics

    def make_groups(self, tasks: list[str], trajs: list[Trajectory]) -> list[Group]:
        """Per task: drop infrastructure failures, inject a replayed success into all-failed groups
        (ARPO), store fresh successes, compute advantages."""
        groups = []
        for task in dict.fromkeys(tasks):
            fresh = [t for t in trajs if t.task == task and t.ok]
            if len(fresh) < 2:
                # No comparison possible (all but one rollout hit infrastructure failures), but a
                # lone success is still a success: it goes into the replay buffer, as in ARPO.
                for t in fresh:
                    self.replay.add(task, t.replay_item(), t.task_score)
                continue
            result = self.replay.maybe_inject(task, [t.replay_item() for t in fresh], [t.task_score for t in fresh])
            group = list(fresh)
            if result.injected:
                replayed = load_trajectory(result.group[result.replaced]["dir"], self.policy.processor)
                replayed.replayed = True
                group[result.replaced] = replayed
            for t in fresh:  # after injection, with the fresh (pre-replacement) group
                self.replay.add(task, t.replay_item(), t.task_score)
            adv = ADV_ESTIMATORS[self.cfg.algo.adv_estimator](
                torch.tensor([t.reward for t in group], dtype=torch.float64), self.cfg.algo).tolist()
            groups.append(Group(task, group, adv, result.injected, result.all_failed))
        return groups

    # -- the policy update -------------------------------------------------------------------------
    def update(self, groups: list[Group]) -> dict[str, Any]:
        """One PPO epoch over the batch, split into `updates_per_batch` optimizer steps."""
        t, a = self.cfg.train, self.cfg.algo
        items = [(seg, adv, traj) for g in groups for traj, adv in zip(g.trajectories, g.advantages)
                 for seg in traj.segments if any(seg.loss_mask)]
        stats = UpdateMetrics(len(items), groups, self.weights_version)
        if not items:
            return stats.result()
        random.Random(stable_seed(t.seed, "shuffle", self.step)).shuffle(items)
        # A sequence with advantage 0 has zero policy loss and gradient, so it is not run through
        # the model -- unless a KL term to the reference depends on it too.
        with_kl = self.reference is not None and a.kl_coef > 0
        minibatches = [items[i::t.updates_per_batch] for i in range(t.updates_per_batch)]
        # Which micro-batches this process runs in each mini-batch: all of them, or its share.
        plans = [self.backend.plan([(s, adv) for s, adv, _ in mb if adv != 0.0 or with_kl]) for mb in minibatches]
        mine = {id(s) for plan in plans for micro, _ in plan for s, _ in micro}
        # Old log-probs before any update (ratio starts at 1, as ARPO), and with
        # algo.replay.correction=tis the truncated importance weights of replayed members.
        old: dict[int, torch.Tensor] = {}
        is_weights: dict[int, torch.Tensor] = {}
        for seg, _, traj in (item for item in items if id(item[0]) in mine):
            behaviour = torch.tensor([lp for lp, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
            with torch.no_grad():
                old[id(seg)] = (behaviour if a.old_logprobs == "behaviour" else
                                self.policy.sequence_logprobs([seg], self.rollouts.temperature)[0].detach().cpu())
            if a.replay.correction == "tis" and traj.replayed:
                is_weights[id(seg)] = truncated_is_weights(old[id(seg)].double(), behaviour.double(),
                                                           a.replay.tis_cap).float()
        stats.add(is_weight_stats(items, plans, is_weights, self.backend, a.replay.tis_cap))
        self.backend.train_mode()
        for mb, plan in zip(minibatches, plans):
            if not mb:
                continue
            n_tok = sum(sum(seg.loss_mask) for seg, _, _ in mb)
            self.optimizer.zero_grad(set_to_none=True)
            sums = self._gradients(plan, len(mb), n_tok, old, is_weights)
            norm = self.backend.clip_grad_norm(self.optimizer, t.grad_clip)
            if math.isfinite(norm):
                self.optimizer.step()
                self.scheduler.step()  # the schedule counts the optimizer steps taken
                self.consecutive_skips = 0
                self.weights_version += 1
            else:
                self._skip_step(norm)
            stats.minibatch(sums, ran=bool(plan), norm=norm, tokens=n_tok)
        self.backend.after_update(stepped=stats.optimizer_steps > 0)
        return stats.result()

    def _gradients(self, plan: Plan, n_seq: int, n_tok: int, old: dict[int, torch.Tensor],
                   is_weights: dict[int, torch.Tensor]) -> list[float]:
        """One mini-batch's clipped loss into the gradients, micro-batch by micro-batch; returns its
        loss, clip fraction, approx. KL and KL to the reference (token means, summed over ranks)."""
        a, temperature = self.cfg.algo, self.rollouts.temperature
        sums = [0.0, 0.0, 0.0, 0.0]
        for micro, live in plan:
            segs = [s for s, _ in micro]
            new = self.backend.logprobs(segs, temperature)
            logprobs = _pad(new)
            old_lp = _pad([old[id(s)].to(logprobs.device) for s in segs])
            mask = _pad([torch.ones_like(t) for t in new])
            advs = torch.tensor([adv for _, adv in micro], dtype=logprobs.dtype, device=logprobs.device)
            ref_lp = weights = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_lp = _pad(self.policy.sequence_logprobs(segs, temperature, model=self.reference))
            if is_weights:
                weights = _pad([is_weights.get(id(s), torch.ones(len(o))).to(logprobs.device)
                                for s, o in zip(segs, new)])
            loss, m = POLICY_LOSSES[a.policy_loss](logprobs, old_lp, advs, mask, a, ref_logprobs=ref_lp,
                                                   is_weights=weights)
            # Exact aggregation across micro-batches (and ranks): weight by this micro-batch's
            # share of the whole mini-batch.
            share = float(mask.sum()) / n_tok if a.aggregation == "token-mean" else len(micro) / n_seq
            self.backend.backward(loss, share, live)
            if live:  # the metrics: token means over the mini-batch, whatever its partition
                tokens = float(mask.sum()) / n_tok
                part = [loss.item() * share] + [m.get(k, 0.0) * tokens for k in ("clip_fraction", "approx_kl", "kl")]
                sums = [s + p for s, p in zip(sums, part)]
        return self.backend.all_reduce_sum(sums)

    def _skip_step(self, norm: float) -> None:
        """A non-finite gradient: drop it instead of letting one NaN poison every weight (and
        every checkpoint after it), as ARPO does; stop after `train.max_skipped_steps` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips += 1
        log.warning("step %d: the gradient norm is %s: optimizer step skipped (%d in a row)",
                    self.step, norm, self.consecutive_skips)
        limit = self.cfg.train.max_skipped_steps
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteGradientError(
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite gradient norm ({norm}): "
                f"the run is stopped before it trains on garbage. The last checkpoint in {self.run.checkpoints} "
                "is intact; look for NaN/inf in the log-probs or rewards, lower train.lr, or raise "
                "train.max_skipped_steps to tolerate more.")

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
        """Put `train.demo_replay` scripted demonstrations per task into the replay buffer (once,
        before the first step; they are saved with the buffer). Returns how many were stored."""
        return self.sft.seed_replay(self.replay) if self.step == 0 and self.replay.enabled else 0

    def evaluate(self, label: str, tasks: list[str] | None = None) -> "EvalResult":
        """Evaluate the current policy with the run's protocol into <run>/eval/<label>."""
        return self.evaluator(self.rollouts.engine(self.weights_version, announce=False), label, tasks)

    def save_checkpoint(self) -> Path:
        """Write this step's checkpoint (distributed: every rank calls this)."""
        return self.checkpoints.save(self.step, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                                     replay=self.replay, config=self.cfg.to_dict(),
                                     state={"consecutive_skips": self.consecutive_skips,
                                            "weights_version": self.weights_version})


def _pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
