"""Whole tensors from FSDP2 shards, one at a time: what a weight push and a saved model walk over.

Here, below both the training package (the memory model measures this loop) and the serving package
(the streamed push runs it), so that neither imports the other.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch


def full_tensors(params: Sequence[tuple[str, torch.Tensor]], device: torch.device,
                 dtypes: Sequence[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor on `device` in its wire dtype) for each of `params`, one at a time: a
    DTensor shard is gathered (`full_tensor()`, every rank takes part) only when its turn comes,
    so the caller holds one parameter's full tensor above the shards, never more, as long as it
    drops each before asking for the next (the measured memory table walks this same loop)."""
    for (name, param), dtype in zip(params, dtypes):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        full = full.detach().to(device=device, dtype=dtype).contiguous()  # the gathered one is freed here
        yield name, full
        del full  # before the next one is gathered
