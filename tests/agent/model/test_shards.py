"""The pass over whole tensors that a weight push and a saved model walk (agent/model/shards.py):
on a GPU gathered one ahead of the caller (at most two above the shards), on the CPU one at a
time, each seen once before any copy."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from arpo_lib.agent.model.shards import full_tensors


class _Shard:
    """A DTensor's part in the pass: `full_tensor()` is the gather every rank joins (logged)."""

    def __init__(self, name: str, whole: torch.Tensor, log: list[str]):
        self.name, self.whole, self.log = name, whole, log
        self.shape, self.dtype, self.device = whole.shape, whole.dtype, whole.device

    def full_tensor(self) -> torch.Tensor:
        self.log.append(f"gather {self.name}")
        return self.whole.clone()


def _params(log: list[str], n: int = 4) -> list[tuple[str, _Shard]]:
    return [(f"w{i}", _Shard(f"w{i}", torch.full((3, 5), float(i) + 0.25), log)) for i in range(n)]


def _walk(params, **kwargs) -> int:
    """Send each tensor (logged); returns the most whole tensors alive at a send."""
    alive: list[weakref.ref] = []
    most = 0
    log = params[0][1].log
    for name, full in full_tensors(params, torch.device("cpu"), [torch.bfloat16] * len(params),
                                   on_gathered=lambda n, t: alive.append(weakref.ref(t)), **kwargs):
        log.append(f"send {name}")
        assert full.dtype == torch.bfloat16 and float(full[0, 0]) == float(name[1:]) + 0.25
        gc.collect()
        most = max(most, sum(r() is not None for r in alive))
        del full
    return most


def test_ahead_the_next_tensor_is_gathered_before_the_last_is_handed_over_and_at_most_two_are_alive():
    log: list[str] = []
    assert _walk(_params(log), ahead=True) == 2  # the one being sent and the next, never a third
    assert log == ["gather w0", "gather w1", "send w0", "gather w2", "send w1", "gather w3", "send w2", "send w3"]


def test_on_the_cpu_the_pass_is_one_tensor_at_a_time():
    """Nothing to overlap there (every step is synchronous): one whole tensor above the shards."""
    log: list[str] = []
    assert _walk(_params(log)) == 1
    assert log == ["gather w0", "send w0", "gather w1", "send w1", "gather w2", "send w2", "gather w3", "send w3"]


def test_each_tensor_is_seen_once_cast_and_on_the_device_it_was_gathered_on_before_the_copy():
    log: list[str] = []
    params = _params(log, 3)
    seen: list[tuple[str, torch.dtype, str]] = []
    out = list(full_tensors(params, torch.device("meta"), [torch.bfloat16, torch.float16, torch.float32],
                            on_gathered=lambda n, t: seen.append((n, t.dtype, t.device.type))))
    assert seen == [("w0", torch.bfloat16, "cpu"), ("w1", torch.float16, "cpu"), ("w2", torch.float32, "cpu")]
    assert [(n, t.dtype, t.device.type) for n, t in out] == [("w0", torch.bfloat16, "meta"),
                                                              ("w1", torch.float16, "meta"),
                                                              ("w2", torch.float32, "meta")]


def test_a_caller_that_stops_early_ahead_leaves_only_the_one_gathered_ahead():
    """What a failed send does: the pass has gathered one more than was sent (the others were
    told of that gather), and nothing after it."""
    log: list[str] = []
    params = _params(log)
    passes = full_tensors(params, torch.device("cpu"), [torch.float32] * len(params), ahead=True)
    next(passes)
    passes.close()
    assert log == ["gather w0", "gather w1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the pinned host copy)")
def test_from_a_gpu_to_the_host_each_tensor_arrives_whole_in_pinned_memory():
    log: list[str] = []
    params = [(f"w{i}", _Shard(f"w{i}", torch.randn(1024, 1024, device="cuda"), log)) for i in range(4)]
    sums = []
    for name, full in full_tensors(params, torch.device("cpu"), [torch.bfloat16] * 4,
                                   on_gathered=lambda n, t: sums.append(t.float().sum())):
        assert log[-1] == f"gather w{min(int(name[1:]) + 1, 3)}"  # one ahead on a GPU
        assert full.device.type == "cpu" and full.is_pinned()
        want = dict(params)[name].whole.to(torch.bfloat16).cpu()
        assert torch.equal(full, want)
    assert len(sums) == 4 and all(s.is_cuda for s in sums)
