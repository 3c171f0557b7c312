"""ARPO's policy update: one PPO epoch over a rollout batch's groups, split into
`train.updates_per_batch` optimizer steps (mini-batches), each run micro-batch by micro-batch
through the training backend (one process or FSDP2).

- Old log-probs are taken before any weight changes (the ratio starts at 1, as ARPO), recomputed
  with the current policy (`algo.old_logprobs=recompute`, ARPO's) or the ones stored at sampling
  time (`behaviour`); with `algo.replay.correction=tis`, replayed members are weighted by
  truncated importance ratios.
- Sequences with advantage exactly 0 count in the loss normaliser but are not run through the
  model (their loss and gradient are exactly zero), unless a KL term (algo.kl_coef) needs them.
- A non-finite gradient skips its optimizer step, as ARPO; `train.max_skipped_steps` in a row stop
  the run (NonFiniteGradientError).

It reads `train.*` and `algo.*`; the loss comes from its registry (`algo.policy_loss`); the
advantages arrive with the groups (the trainer's `make_groups`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
from pathlib import Path
from typing import Any, Iterator

import torch

from arpo_lib.algo import POLICY_LOSSES, truncated_is_weights
from arpo_lib.rollout.store import load_pixels
from arpo_lib.run.config import RunConfig
from arpo_lib.run.seeding import stable_seed
from arpo_lib.training.backend import Plan, TrainingBackend
from arpo_lib.training.metrics import UpdateMetrics, is_weight_stats
from arpo_lib.training.optim import make_optimizer, warmup_schedule
from arpo_lib.types import Group, Segment
from arpo_lib.training.contracts import TrainablePolicy

log = logging.getLogger(__name__)


class NonFiniteGradientError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite gradient (train.max_skipped_steps)."""


class PolicyUpdate:
    """The optimizer, its schedule and the clipped-loss update; `temperature`: the sampling
    temperature the log-probs are taken at; `reference`: the frozen model of the KL term;
    `checkpoints_dir`: named in the error that stops a run of non-finite gradients."""

    def __init__(self, cfg: RunConfig, policy: TrainablePolicy, backend: TrainingBackend, *, temperature: float,
                 reference: torch.nn.Module | None = None, checkpoints_dir: Path | None = None):
        self.cfg, self.policy, self.backend, self.temperature = cfg, policy, backend, temperature
        self.reference, self.checkpoints_dir = reference, checkpoints_dir
        t = cfg.train
        self.optimizer = make_optimizer(t.optimizer, backend.parameters(), t.lr, t.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, t.steps * t.updates_per_batch, t.warmup_ratio,
                                         t.lr_schedule, t.min_lr_ratio)
        self.consecutive_skips = 0
        """Optimizer steps skipped in a row for a non-finite gradient (checkpointed by the trainer)."""

    def __call__(self, groups: list[Group], step: int, weights_version: int) -> dict[str, Any]:
        """One PPO epoch over the batch of rollout step `step`, split into `updates_per_batch`
        optimizer steps; `weights_version`: the weights' version before it (for the replay ages).
        Returns the update's metrics; their `optimizer_steps` is how many weight changes it made."""
        t, a = self.cfg.train, self.cfg.algo
        items = [(seg, adv, traj) for g in groups for traj, adv in zip(g.trajectories, g.advantages)
                 for seg in traj.segments if any(seg.loss_mask)]
        stats = UpdateMetrics(len(items), groups, weights_version)
        if not items:
            return stats.result()
        random.Random(stable_seed(t.seed, "shuffle", step)).shuffle(items)
        # A sequence with advantage 0 has zero policy loss and gradient, so it is not run through
        # the model -- unless a KL term to the reference depends on it too.
        with_kl = self.reference is not None and a.kl_coef > 0
        minibatches = [items[i::t.updates_per_batch] for i in range(t.updates_per_batch)]
        # Which micro-batches this process runs in each mini-batch: all of them, or its share.
        plans = [self.backend.plan([(s, adv) for s, adv, _ in mb if adv != 0.0 or with_kl]) for mb in minibatches]
        mine = {id(s) for plan in plans for micro, _ in plan for s, _ in micro}
        # Old log-probs before any update (ratio starts at 1, as ARPO), and with
        # algo.replay.correction=tis the truncated importance weights of replayed members.
        ran = [item for item in items if id(item[0]) in mine]
        directories = {id(seg): traj.directory for seg, _, traj in items}
        recomputed = self._old_logprobs(plans, directories) if a.old_logprobs == "recompute" else {}
        old: dict[int, torch.Tensor] = {}
        is_weights: dict[int, torch.Tensor] = {}
        for seg, _, traj in ran:
            behaviour = torch.tensor([lp for lp, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
            old[id(seg)] = behaviour if a.old_logprobs == "behaviour" else recomputed[id(seg)]
            stale = not traj.replayed and traj.policy_version < weights_version  # sampled ahead of this update
            if (a.replay.correction == "tis" and traj.replayed) or (a.stale_correction == "tis" and stale):
                is_weights[id(seg)] = truncated_is_weights(old[id(seg)].double(), behaviour.double(),
                                                           a.replay.tis_cap).float()
        stats.add(is_weight_stats(items, plans, is_weights, self.backend, a.replay.tis_cap))
        self.backend.train_mode()
        for mb, plan in zip(minibatches, plans):
            if not mb:
                continue
            n_tok = sum(sum(seg.loss_mask) for seg, _, _ in mb)
            self.optimizer.zero_grad(set_to_none=True)
            sums = self._gradients(plan, len(mb), n_tok, old, is_weights, directories)
            norm = self.backend.clip_grad_norm(self.optimizer, t.grad_clip)
            if math.isfinite(norm):
                self.optimizer.step()
                self.scheduler.step()  # the schedule counts the optimizer steps taken
                self.consecutive_skips = 0
            else:
                self._skip_step(norm, step)
            stats.minibatch(sums, ran=bool(plan), norm=norm, tokens=n_tok)
        self.backend.after_update(stepped=stats.optimizer_steps > 0)
        return stats.result()

    @contextlib.contextmanager
    def _pixels(self, segs: list[Segment], directories: dict[int, str | None]) -> Iterator[None]:
        """The screenshots of one micro-batch as pixels while it runs. A segment without them (its
        episode's were dropped once written to disk, or it is another rank's episode) is
        re-encoded from its trajectory directory and dropped again after: the update holds one
        micro-batch's pixels, not the batch's (a 1080p screenshot is ~50 MB of fp32 pixels, up to 15
        per episode: ~130 GB at 32x8 episodes)."""
        loaded = [s for s in segs if s.screenshot_steps and not s.pixel_values]
        try:
            for seg in loaded:
                load_pixels(seg, directories[id(seg)], self.policy.processor)
            yield
        finally:
            for seg in loaded:
                seg.pixel_values = []

    def _old_logprobs(self, plans: list[Plan], directories: dict[int, str | None]) -> dict[int, torch.Tensor]:
        """The backend's old log-probs, one micro-batch at a time (each with its pixels loaded),
        in the plans' order; a sequence's first micro-batch gives its log-probs."""
        out: dict[int, torch.Tensor] = {}
        for plan in plans:
            for micro, live in plan:
                with self._pixels([s for s, _ in micro], directories):
                    for key, lp in self.backend.old_logprobs([[(micro, live)]], self.temperature).items():
                        out.setdefault(key, lp)
        return out

    def _gradients(self, plan: Plan, n_seq: int, n_tok: int, old: dict[int, torch.Tensor],
                   is_weights: dict[int, torch.Tensor], directories: dict[int, str | None]) -> list[float]:
        """One mini-batch's clipped loss into the gradients, micro-batch by micro-batch; returns its
        loss, clip fraction, approx. KL and KL to the reference (token means, summed over ranks)."""
        a, temperature = self.cfg.algo, self.temperature
        sums = [0.0, 0.0, 0.0, 0.0]
        for micro, live in plan:
            segs = [s for s, _ in micro]
            with self._pixels(segs, directories):
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
                    part = [loss.item() * share] + [m.get(k, 0.0) * tokens
                                                    for k in ("clip_fraction", "approx_kl", "kl")]
                    sums = [s + p for s, p in zip(sums, part)]
        return self.backend.all_reduce_sum(sums)

    def _skip_step(self, norm: float, step: int) -> None:
        """A non-finite gradient: drop it instead of letting one NaN poison every weight (and
        every checkpoint after it), as ARPO does; stop after `train.max_skipped_steps` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips += 1
        log.warning("step %d: the gradient norm is %s: optimizer step skipped (%d in a row)",
                    step, norm, self.consecutive_skips)
        limit = self.cfg.train.max_skipped_steps
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteGradientError(
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite gradient norm ({norm}): "
                f"the run is stopped before it trains on garbage. The last checkpoint in {self.checkpoints_dir} "
                "is intact; look for NaN/inf in the log-probs or rewards, lower train.lr, or raise "
                "train.max_skipped_steps to tolerate more.")


def _pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
