"""Micro-batches sized by a token budget instead of a fixed number of sequences.

ARPO's sequences range from one screenshot (~3k tokens at 1080p) to fifteen (~40k). A fixed
micro-batch size either wastes the GPU on short ones or runs out of memory on long ones. Here
sequences are sorted by length and packed greedily into micro-batches whose padded size
(rows x longest row) stays within `budget` tokens; a sequence longer than the budget goes alone.
Sorting also keeps padding small. The trainer weights each micro-batch's loss by its share of the
mini-batch, so the gradient is the same whatever the grouping.
"""
from __future__ import annotations

from typing import Sequence


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
