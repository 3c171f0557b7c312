"""HFPolicy's own memory behaviour: generation holds one copy of the weights.

Autocast keeps the low-precision copy of every fp32 weight that requires grad until its context
exits (so that a backward finds the copy its forward used). Generation runs without gradients,
yet the weights still require them: it kept a bf16 copy of the whole model beside the fp32 one
through every forward (7B: ~14 GiB beside 30.9 GiB). Measured here on the CPU, where autocast
casts to bf16 the same way: a dispatch mode records every cast of a parameter and how many bytes
of such copies are alive at once."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from arpo_lib.agent.hf_policy import pad_segments
from arpo_lib.types import SamplingParams
from benchmarks.common import screenshot


class _LiveWeightCasts(TorchDispatchMode):
    """Bytes of the copies of `params` that operations make (autocast's casts), alive at once:
    `peak`, and `casts`, how many were made. A copy counts from its creation until its storage is
    freed."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, weakref.ref] = {}
        self.now = self.peak = self.casts = 0

    def _freed(self, key: int, nbytes: int) -> None:
        self.live.pop(key, None)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.params:
            for t in pytree.tree_leaves(out):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                self.live[key] = weakref.ref(storage, lambda _, key=key, n=nbytes: self._freed(key, n))
                self.now += nbytes
                self.casts += 1
                self.peak = max(self.peak, self.now)
        return out


@pytest.fixture(scope="module")
def bf16_policy(tiny_model):
    """fp32 weights that require grad, forwards in bf16 under autocast: a GPU run's set-up."""
    from arpo_lib.agent.hf_policy import HFPolicy

    policy = HFPolicy(tiny_model, device="cpu", compute_dtype="bfloat16", max_new_tokens=8)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in policy.model.parameters())
    return policy


def _bf16_bytes(params) -> list[int]:
    return [p.numel() * 2 for p in params]


@pytest.mark.parametrize("cached", [False, True], ids=["reprefill", "kv-cached"])
def test_generation_keeps_no_bf16_copy_of_the_model(bf16_policy, cached):
    policy = bf16_policy
    params = list(policy.model.parameters())
    copies = _bf16_bytes(params)
    conv = policy.new_conversation("Click the button")
    for step in range(2):  # the second step: a prefill over a cached prefix, then decoding
        conv.add_observation(screenshot(step))
        with _LiveWeightCasts(params) as casts:
            (gen,) = policy.generate([conv.current], seeds=[step], cache_keys=[("ep", 0)] if cached else None,
                                     sampling=SamplingParams(temperature=1.0, max_new_tokens=8))
        conv.add_response(gen.text, gen.token_ids, gen.logprobs)
        assert casts.casts > 0  # the measure sees autocast's casts
        # One weight's copy at a time (with its bias), never the model's: before, the whole model's
        # (qwen2vl: 726,912 of 728,832 bytes; now 150,528, the LM head's).
        assert casts.peak <= 1.1 * max(copies) < sum(copies) / 4, (casts.peak, max(copies), sum(copies))
        assert casts.now == 0  # nothing cast outlives the call
    policy.release(("ep", 0))


def test_the_measure_sees_autocast_keep_every_copy(bf16_policy):
    """What generation did before: one forward under autocast with its cast cache on (the default,
    kept until the context exits) holds a bf16 copy of every weight a matmul used."""
    policy = bf16_policy
    params = list(policy.model.parameters())
    conv = policy.new_conversation("Click the button")
    conv.add_observation(screenshot(0))
    batch = pad_segments([conv.current], policy.pad_id, side="left")
    batch.pop("loss_mask")
    linears = [m.weight for m in policy.model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad(), _LiveWeightCasts(params) as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy.model(**batch)
            at_exit = casts.now
    assert at_exit >= sum(_bf16_bytes(linears)) and casts.now == 0, (at_exit, sum(_bf16_bytes(linears)))
