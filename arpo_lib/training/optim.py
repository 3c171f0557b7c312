"""The optimizer, its learning-rate schedule, and micro-batches sized by a token budget.

Optimizers: `adamw` (fused on CUDA) or `adafactor` (factored second moments, ~no optimizer
state: what lets a 7B full fine-tune fit; see arpo_lib/agent/model/lora.py for the memory budget).

Token-budget micro-batches: ARPO's sequences range from one screenshot (~3k tokens at 1080p) to
fifteen (~40k). A fixed micro-batch size either wastes the GPU on short ones or runs out of memory
on long ones. Here sequences are sorted by length and packed greedily into micro-batches whose
padded size (rows x longest row) stays within `budget` tokens; a sequence longer than the budget
goes alone. Sorting also keeps padding small. The trainer weights each micro-batch's loss by its
share of the mini-batch, so the gradient is the same whatever the grouping.
"""
from __future__ import annotations

import math
from typing import Sequence, TypeVar

import torch

from arpo_lib.run.config import LR_SCHEDULES

T = TypeVar("T")


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """`adamw` (fused on CUDA: one kernel for all parameters) or `adafactor` (low memory)."""
    if name == "adamw":
        fused = bool(params) and all(p.is_cuda for p in params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r} (adamw or adafactor)")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, factored statistics)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


def lr_factor(update: int, total_updates: int, warmup_ratio: float, schedule: str = "constant",
              min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `update` (0-based) as a share of the peak: linear
    warm-up over the first `warmup_ratio` of `total_updates` (ARPO's subset run: 5%; the first step
    already uses lr / warmup, not 0), then `constant` (ARPO), or a `cosine` or `linear` decay that
    reaches `min_lr_ratio` at the last step (verl's cosine schedule with its min_lr_ratio)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r} ({', '.join(LR_SCHEDULES)})")
    total = max(1, total_updates)
    warmup = math.ceil(warmup_ratio * total)
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup - 1))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_schedule(optimizer: torch.optim.Optimizer, total_updates: int, warmup_ratio: float,
                    schedule: str = "constant", min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR over `lr_factor` (its state is one counter, saved in every checkpoint)."""
    lr_factor(0, total_updates, warmup_ratio, schedule, min_lr_ratio)  # unknown schedule: fail here
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lr_factor(u, total_updates, warmup_ratio, schedule, min_lr_ratio))


def token_budget_batches(lengths: Sequence[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Indices grouped into micro-batches (longest first) whose size stays within `budget` tokens:
    rows x max(length) for padded rows, sum(length) when the micro-batch is packed into one row."""
    if budget <= 0:
        raise ValueError("token budget must be positive")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        size = sum(lengths[j] for j in current) + lengths[i] if packed else (len(current) + 1) * longest
        if current and size > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of the padded tokens that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    real = sum(lengths[i] for b in batches for i in b)
    return 0.0 if padded == 0 else 1.0 - real / padded


def micro_batches(items: Sequence[T], lengths: Sequence[int], token_budget: int, size: int,
                  packed: bool = False) -> list[list[T]]:
    """`items` in micro-batches: by token budget when `token_budget` > 0 (`token_budget_batches`),
    else `size` at a time in order."""
    if token_budget > 0:
        return [[items[i] for i in b] for b in token_budget_batches(lengths, token_budget, packed=packed)]
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
