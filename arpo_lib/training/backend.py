"""Where the update runs: one process, or N torchrun processes with an FSDP2-sharded copy of the
model. The trainer's one interface to the distributed details; the algorithm never asks which.

    backend = training_backend(policy, ranks, ...)   # SingleProcess, or FSDP2 under torchrun
    plan    = backend.plan(sequences)                # this process's micro-batches, each (micro, live)
    backend.backward(loss, share, live)              # the mini-batch's gradient, exactly as one process
    sums    = backend.all_reduce_sum(values)         # metrics summed over ranks
    backend.after_update(stepped)                    # FSDP2: the shards' weights into the full model
    backend.save_policy(directory)                   # every rank; rank 0 writes (gathered from shards)

What the trainer leaves to it: the module the update trains and its parameters, the split of each
mini-batch into micro-batches (`train.micro_batch_size`, `train.token_budget`, `train.pack`) and
over ranks (with padding micro-batches: FSDP2 needs every rank in every forward), the
gradient scale and norm, moving weights between the sharded and the full model (after an update,
after the warm start), the episodes' split and gather, and the optimizer state in and out of a
checkpoint. The collectives themselves are `training.distributed`'s (identities on one process).
"""
from __future__ import annotations

import abc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from arpo_lib.agent.model.lora import merged_weights
from arpo_lib.training import distributed as dist_
from arpo_lib.training.checkpoint import load_optimizer_state, save_optimizer_shards
from arpo_lib.training.distributed import SINGLE, Ranks
from arpo_lib.training.optim import micro_batches

if TYPE_CHECKING:
    from arpo_lib.agent.model.logprobs import LogprobNet
    from arpo_lib.agent.prompt import Segment
    from arpo_lib.training.contracts import TrainablePolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
Sequences = list[tuple["Segment", float]]
"""A mini-batch's sequences to run, each with its advantage."""
Plan = list[tuple[Sequences, bool]]
"""This process's micro-batches of one mini-batch, each with `live` (False: padding, loss times 0)."""


class TrainingBackend(abc.ABC):
    """What both backends share: this process's place among the ranks and the collectives over
    them (identities for one process), micro-batches of at most `micro_batch_size` sequences or
    (`token_budget` > 0) of padded tokens, run packed (`pack`). Subclasses own the trained model."""

    sharded_optimizer = False
    """The optimizer state is sharded over the ranks (checkpointed as torch.distributed.checkpoint shards)."""
    keeps_full_model = True
    """Every rank holds the whole model (`policy.model`). False (FSDP2 with model servers): only the
    shards, so whoever writes or sends the weights gathers them with every rank."""

    def __init__(self, policy: "TrainablePolicy", ranks: Ranks, *, micro_batch_size: int = 1, token_budget: int = 0,
                 pack: bool = False):
        self.policy, self.ranks = policy, ranks
        self.micro_batch_size, self.token_budget, self.pack = micro_batch_size, token_budget, pack

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    # -- the update --------------------------------------------------------------------------------
    @abc.abstractmethod
    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates."""

    @abc.abstractmethod
    def logprobs(self, segments: Sequence["Segment"], temperature: float) -> list[torch.Tensor]:
        """The training forward of a micro-batch: log-probs (with grad) of each segment's trained tokens."""

    @abc.abstractmethod
    def plan(self, sequences: Sequences) -> Plan:
        """This process's micro-batches of a mini-batch's sequences."""

    def old_logprobs(self, plans: Sequence[Plan], temperature: float) -> dict[int, torch.Tensor]:
        """The log-probs before the update (the PPO ratio's denominator) of every sequence in
        `plans`, by `id`, on the CPU: one sequence at a time through the policy's model."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for plan in plans:
                for micro, _ in plan:
                    for seg, _ in micro:
                        if id(seg) not in out:
                            out[id(seg)] = self.policy.sequence_logprobs([seg], temperature)[0].detach().cpu()
        return out

    def split(self, sequences: Sequences) -> list[Sequences]:
        """`sequences` in micro-batches, in order or (token budget) sorted by length."""
        return micro_batches(sequences, [len(s) for s, _ in sequences], self.token_budget, self.micro_batch_size,
                             packed=self.pack)

    def backward(self, loss: torch.Tensor, share: float, live: bool) -> None:
        """Add `loss` times its `share` of the mini-batch to the gradient. FSDP averages gradients
        over ranks, hence times the world size; a padding micro-batch counts 0."""
        (loss * (share * self.ranks.world_size if live else 0.0)).backward()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the optimizer's gradients to `max_norm`; returns the global norm before clipping."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor when sharded

    def train_mode(self) -> None:
        self.policy.model.train()

    def after_update(self, stepped: bool) -> None:
        """Back to evaluation mode after an update (`stepped`: an optimizer step was taken)."""
        self.policy.model.eval()

    def after_warm_start(self) -> None:
        """The full model was trained outside the update (on rank 0): every rank gets it."""

    # -- the weights, whole ------------------------------------------------------------------------
    def full_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight, in checkpoint naming, tied weights once, for rank 0 to
        write or send: the full model's parameters, or (no full copy) the shards' DTensors, each
        gathered in its turn by the consumer while every other rank runs `join_full_weights`.
        With LoRA, the merged weights under the base model's names, each merged in its turn."""
        if getattr(self.policy, "peft_model", None) is not None:
            return merged_weights(self.policy.model)
        return list(self.policy.model.named_parameters())

    def join_full_weights(self) -> None:
        """A rank other than 0: its part in rank 0's pass over `full_weights` (nothing to do where
        every rank holds the full model); raises `distributed.RankFailed` when rank 0 stops it."""

    def expect_weights_pass(self) -> None:
        """Rank 0, having told the others that a pass over `full_weights` follows: they wait in its
        gathers from now on, so a failure before the first gather must stop it too (nothing to do
        where every rank holds the full model)."""

    def stop_weights_pass(self, error: str = "rank 0 stopped (its log says why)") -> None:
        """Rank 0, failing: the other ranks waiting in a pass over the weights it left unfinished
        (a push that failed mid-way) raise now, with `error` (nothing to do where every rank holds
        the full model)."""

    def save_policy(self, directory: Path) -> None:
        """The policy in the Hugging Face layout, written by rank 0 into `directory`. Every rank calls
        this (without a full copy the weights are gathered with every rank)."""
        if self.is_main:
            self.policy.save(directory)

    # -- checkpoints -------------------------------------------------------------------------------
    @abc.abstractmethod
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | Path) -> None:
        """A checkpoint's optimizer state, whichever number of processes wrote it."""

    def save_optimizer_shards(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps the optimizer state whole")

    # -- the work split and the collectives --------------------------------------------------------
    def share(self, items: Sequence[T]) -> list[T]:
        """This process's share of `items` (the episodes of a rollout batch)."""
        return list(items[self.ranks.rank::self.ranks.world_size])

    def gather(self, mine: list[T]) -> list[T]:
        """Every process's `share`, back in the original order, on every process."""
        return dist_.interleave(dist_.gather_objects(mine, self.ranks))

    def gather_lists(self, mine: list[T]) -> list[list[T]]:
        """Every process's list, on every process."""
        return dist_.gather_objects(mine, self.ranks)

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return dist_.all_reduce_sum(values, self.ranks)

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every process."""
        return dist_.broadcast_object(obj, self.ranks)

    def barrier(self) -> None:
        dist_.barrier(self.ranks)

    def on_main(self, work: Callable[[], T]) -> T | None:
        """`work()` on rank 0 while the other ranks wait for it (they get None, or raise
        `distributed.RankFailed` when it fails: `distributed.on_main`)."""
        return dist_.on_main(work, self.ranks)

    def close(self, failed: bool = False) -> None:
        """Leave the process group; `failed`: without waiting for the others (they may be stuck in
        a collective this rank will never join; torchrun stops them when this process exits)."""
        if failed:
            dist_.abandon_process_group(self.ranks)
        else:
            dist_.close_process_group(self.ranks)


class SingleProcess(TrainingBackend):
    """One process trains the policy's own model."""

    def __init__(self, policy: "TrainablePolicy", **micro_batching: Any):
        super().__init__(policy, SINGLE, **micro_batching)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.trainable_parameters()

    def logprobs(self, segments: Sequence["Segment"], temperature: float) -> list[torch.Tensor]:
        return self.policy.sequence_logprobs(segments, temperature, pack=self.pack, model=None)

    def plan(self, sequences: Sequences) -> Plan:
        return [(m, True) for m in self.split(sequences)]

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | Path) -> None:
        load_optimizer_state(state, optimizer, self.policy.model, sharded=None)


class FSDP2(TrainingBackend):
    """N processes (torchrun): each trains its share of every mini-batch on an FSDP2-sharded copy
    of the model (`distributed.shard_for_training`), which also computes the update's old
    log-probs.

    `keep_full_model=True` (in-process rollouts): every rank also keeps the full model to generate
    with, and the shards' weights go back into it after every update (`sync_full_model`).
    `keep_full_model=False` (rollouts on model servers): nothing generates in this process, so the
    full model is dropped to the meta device when training starts (after the warm start, which
    trains it on rank 0); from then on the weights exist only as shards, and a push to the servers
    or a saved model gathers them one parameter at a time with every rank taking part
    (`full_weights`, `join_full_weights`, `save_policy`). On 8 ranks at 7B that is 31 GB less on
    every GPU (benchmarks/results/memory_measured.json)."""

    sharded_optimizer = True

    def __init__(self, policy: "TrainablePolicy", ranks: Ranks, *, keep_full_model: bool = True,
                 **micro_batching: Any):
        super().__init__(policy, ranks, **micro_batching)
        self.net: LogprobNet | None = dist_.shard_for_training(policy.model, policy.forward_logprobs,
                                                               compute_dtype=policy.compute_dtype)
        """The sharded copy the update trains (None once closed: freed before the group ends)."""
        self.keeps_full_model = keep_full_model
        self.full_model_released = False
        """keep_full_model=False: the full model is on the meta device now."""
        self.weights_pass: dist_.WeightPass | None = None
        """Rank 0: its latest pass over the shards' weights (`stop_weights_pass`)."""

    def release_full_model(self) -> None:
        """Without keep_full_model: drop every rank's full copy (to the meta device; its structure,
        names and configuration stay) once the shards hold everything. Idempotent."""
        if self.keeps_full_model or self.full_model_released:
            return
        self.policy.model.to("meta")
        self.full_model_released = True
        log.info("rank %d: the full model is dropped (rollouts on model servers); the weights live in the FSDP2 "
                 "shards only", self.ranks.rank)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self._net.parameters() if p.requires_grad]

    def logprobs(self, segments: Sequence["Segment"], temperature: float) -> list[torch.Tensor]:
        return self.policy.sequence_logprobs(segments, temperature, pack=self.pack, model=self._net)

    def plan(self, sequences: Sequences) -> Plan:
        return rank_plan(sequences, self.split, self.ranks.rank, self.ranks.world_size)

    def old_logprobs(self, plans: Sequence[Plan], temperature: float) -> dict[int, torch.Tensor]:
        """From the shards, micro-batch by micro-batch on the update's own plan (padding ones too:
        every rank runs as many forwards), so the first micro-batch's ratio is exactly 1 on any
        number of ranks and in any precision (the full model under autocast and the bf16 shards
        differ by up to 0.1 in log-prob)."""
        self.release_full_model()
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for plan in plans:
                for micro, _ in plan:
                    segs = [s for s, _ in micro]
                    for seg, lp in zip(segs, self.logprobs(segs, temperature)):
                        out.setdefault(id(seg), lp.detach().cpu())
        return out

    def train_mode(self) -> None:
        self.release_full_model()
        super().train_mode()
        self._net.train()

    def after_update(self, stepped: bool) -> None:
        super().after_update(stepped)
        self._net.eval()
        if stepped and self.keeps_full_model:
            dist_.sync_full_model(self._net, self.policy.model)

    def after_warm_start(self) -> None:
        if self.full_model_released:
            raise RuntimeError("the warm start trained a full model this run had already dropped (keep_full_model="
                               "False): the warm start must come before training")
        dist_.broadcast_model(self.policy.model, self.ranks)
        dist_.load_full_into_sharded(self.policy.model, self._net)

    def full_weights(self) -> list[tuple[str, torch.Tensor]]:
        if self.keeps_full_model:
            return super().full_weights()
        expected = self.weights_pass
        if expected is None or expected.gathered or expected.stopped:  # not the one announced
            self.weights_pass = dist_.WeightPass(self._net, self.ranks)
        return self.weights_pass.weights

    def expect_weights_pass(self) -> None:
        if not self.keeps_full_model:
            self.weights_pass = dist_.WeightPass(self._net, self.ranks)

    def on_main(self, work: Callable[[], T]) -> T | None:
        return dist_.on_main(work, self.ranks, open_pass=lambda: self.weights_pass)

    def join_full_weights(self) -> None:
        if not self.keeps_full_model:
            dist_.join_full_weights(self._net, self.ranks)

    def stop_weights_pass(self, error: str = "rank 0 stopped (its log says why)") -> None:
        if self.weights_pass is not None:
            self.weights_pass.stop(error)

    def save_policy(self, directory: Path) -> None:
        if self.keeps_full_model:
            return super().save_policy(directory)
        if self.is_main:
            self.weights_pass = dist_.WeightPass(self._net, self.ranks)
            self.policy.save(directory, state_dict=dist_.gather_to_host(self.weights_pass))
        else:
            dist_.join_full_weights(self._net, self.ranks)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | Path) -> None:
        load_optimizer_state(state, optimizer, self.policy.model, sharded=self._net, control=self.ranks.control)

    def save_optimizer_shards(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        save_optimizer_shards(directory, self._net, optimizer, control=self.ranks.control)

    def close(self, failed: bool = False) -> None:
        if not failed:
            self.net = None  # the FSDP2 copy is freed before the group ends (close_process_group)
        super().close(failed)

    @property
    def _net(self) -> "LogprobNet":
        if self.net is None:
            raise RuntimeError("the FSDP2 backend is closed")
        return self.net


def rank_plan(sequences: Sequences, split: Callable[[Sequences], list[Sequences]], rank: int,
              world_size: int) -> Plan:
    """Rank `rank`'s micro-batches of a mini-batch: its token-balanced share (`split_by_tokens`;
    every rank computes every share) in micro-batches (`split`), padded to the busiest rank's
    count with the shortest sequence, not live: FSDP2 all-gathers in every forward, so every rank
    must run as many."""
    shares = dist_.split_by_tokens([len(s) for s, _ in sequences], world_size)
    per_rank = [split([sequences[i] for i in share]) for share in shares]
    busiest = max(len(p) for p in per_rank)
    plan = [(m, True) for m in per_rank[rank]]
    if len(plan) < busiest:
        shortest = min(sequences, key=lambda a: len(a[0]))
        plan += [([shortest], False)] * (busiest - len(plan))
    return plan


def training_backend(policy: "TrainablePolicy", ranks: Ranks, *, micro_batch_size: int, token_budget: int,
                     pack: bool, keep_full_model: bool = True) -> TrainingBackend:
    """FSDP2 for torchrun's processes (`ranks.world_size` > 1), else one process.
    `keep_full_model=False`: FSDP2's ranks keep only shards once training starts (see `FSDP2`)."""
    micro_batching = {"micro_batch_size": micro_batch_size, "token_budget": token_budget, "pack": pack}
    if ranks.distributed:
        return FSDP2(policy, ranks, keep_full_model=keep_full_model, **micro_batching)
    return SingleProcess(policy, **micro_batching)
