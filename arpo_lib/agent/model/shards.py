"""Whole tensors from FSDP2 shards, one at a time: what a weight push and a saved model walk over.

Here, below both the training package (the memory model measures this loop) and the serving package
(the streamed push runs it), so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

OnGathered = Callable[[str, torch.Tensor], None]


@dataclass
class _Pending:
    """One parameter on its way: gathered and cast on its own device, maybe still being copied."""

    name: str
    tensor: torch.Tensor  # on the caller's device once `copied` (if any) has completed
    source: torch.Tensor | None = None  # kept alive until the asynchronous copy out of it is done
    copied: torch.cuda.Event | None = None


def full_tensors(params: Sequence[tuple[str, torch.Tensor]], device: torch.device,
                 dtypes: Sequence[torch.dtype], on_gathered: OnGathered | None = None,
                 ahead: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor on `device` in its wire dtype) for each of `params`, in order; a
    DTensor shard is gathered (`full_tensor()`, every rank takes part) only when its turn comes.

    `ahead` (None: when the parameters are on a GPU): gather one parameter ahead of the caller.
    While the caller sends tensor k, tensor k+1 is already gathered, cast and, from a GPU to the
    host, on its way into pinned memory: on a GPU these are queued without waiting, so the gather,
    the cast and the copy overlap the send instead of following it. The caller then holds at most
    two parameters' whole tensors above the shards (the one it sends and the next; the planner
    counts the second where the wire tensor stays on the GPU). On the CPU every step is
    synchronous in this one thread, so running ahead would overlap nothing: one at a time there,
    one whole tensor above the shards (what the measured memory table walks), as long as the
    caller drops each before asking for the next.

    `on_gathered(name, tensor)` sees each tensor once, cast, on the device it was gathered on and
    before any copy (a checksum taken there needs no host copy and, on a GPU, no sync)."""
    if ahead is None:
        ahead = bool(params) and getattr(params[0][1], "device", torch.device("cpu")).type == "cuda"
    pending: _Pending | None = None
    for (name, param), dtype in zip(params, dtypes):
        started = _start(name, param, device, dtype, on_gathered)
        if not ahead:
            yield _finish(started)
            del started  # before the next one is gathered
            continue
        if pending is not None:
            yield _finish(pending)
            pending = None  # the caller's tensor is the caller's alone
        pending = started
    if pending is not None:
        yield _finish(pending)


def _start(name: str, param: torch.Tensor, device: torch.device, dtype: torch.dtype,
           on_gathered: OnGathered | None) -> _Pending:
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    full = full.detach().to(dtype=dtype).contiguous()  # a gathered fp32 tensor is freed here
    if on_gathered is not None:
        on_gathered(name, full)
    if full.device == device:
        return _Pending(name, full)
    if full.is_cuda and device.type == "cpu":
        host = torch.empty(full.shape, dtype=dtype, pin_memory=True)
        host.copy_(full, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Pending(name, host, source=full, copied=event)
    return _Pending(name, full.to(device))


def _finish(pending: _Pending) -> tuple[str, torch.Tensor]:
    if pending.copied is not None:
        pending.copied.synchronize()
    pending.source = None
    return pending.name, pending.tensor
