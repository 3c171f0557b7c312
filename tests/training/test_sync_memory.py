"""Memory of the FSDP2 shards beside each rank's full model: building the shards makes
no second copy of the model (it was a `deepcopy`: a second fp32 7B on the GPU at start-up), and
the weight sync after an update gathers one parameter at a time (a full state dict held a second
whole model on every rank: 31 GB at 7B). Run in one process with torch's fake process group at
world size 8, as a 7B job on 8 GPUs would shard; the fake collectives move no data, so only what
is allocated and gathered, and when, is checked (that 2 real ranks train exactly as one process
is tests/training/test_distributed.py's)."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from arpo_lib.training import distributed as dist_


@pytest.fixture
def fake_8_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def sharded_8_ways(fake_8_ranks, tiny_qwen2vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2vl)
    return model, dist_.shard_for_training(model, lambda *a, **k: None, compute_dtype=torch.float32)


class _Allocations(TorchDispatchMode):
    """Bytes of every tensor an operation returns that did not exist before (in-place results are
    their input, views share it: neither counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        self.bytes += sum(s.nbytes() for s in _storages(out) if s.data_ptr() not in inputs)
        return out


def _storages(tree) -> list:
    """The storages of the tensors in `tree` (a DTensor's: its local shard's), meta ones left out."""
    out = []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out.append(t.untyped_storage())
    return out


def test_the_shards_are_built_without_a_second_copy_of_the_model(fake_8_ranks, tiny_qwen2vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2vl)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with _Allocations() as allocated:
        net = dist_.shard_for_training(model, lambda *a, **k: None, compute_dtype=torch.float32)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in net.parameters())
    assert shard_bytes <= model_bytes / 8 * 1.1
    assert allocated.bytes < 0.4 * model_bytes, (allocated.bytes, model_bytes)  # deepcopy: >= model_bytes
    with _Allocations() as copied:
        import copy

        copy.deepcopy(model)
    assert copied.bytes >= model_bytes  # what the measure sees of a whole copy
    for name, p in net.named_parameters():  # this rank's shard holds the model's own values
        whole = dict(model.named_parameters())[name[len("net."):]]
        local = p.to_local()
        assert torch.equal(local, whole[: local.shape[0]]), name  # rank 0: the first rows


class _GatherSpy:
    """Records every gather of a sharded tensor to a whole one (`DTensor.redistribute`, which
    `full_tensor` and torch's full state dicts both use) and how many gathered tensors were alive
    at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.live: list[weakref.ref] = []
        self.peak = 0
        original = DTensor.redistribute

        def redistribute(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            self.peak = max(self.peak, 1 + sum(ref() is not None for ref in self.live))
            self.live.append(weakref.ref(out._local_tensor))
            return out

        monkeypatch.setattr(DTensor, "redistribute", redistribute)


def test_the_sync_gathers_one_parameter_at_a_time(sharded_8_ways, monkeypatch):
    model, net = sharded_8_ways
    spy = _GatherSpy(monkeypatch)
    dist_.sync_full_model(net, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(spy.live) == len(trainable) and spy.peak == 1


def test_the_spy_sees_a_full_state_dict_hold_every_parameter(sharded_8_ways, monkeypatch):
    """What the sync did before (get_model_state_dict(full_state_dict=True)): the spy catches it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, net = sharded_8_ways
    spy = _GatherSpy(monkeypatch)
    state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    assert spy.peak == len(spy.live) >= len(list(model.parameters())) and state


def test_frozen_parameters_are_not_gathered(sharded_8_ways, monkeypatch):
    model, net = sharded_8_ways
    for module in (model, net):
        for name, p in module.named_parameters():
            p.requires_grad_("layers.0." in name)
    spy = _GatherSpy(monkeypatch)
    dist_.sync_full_model(net, model)
    assert 0 < len(spy.live) == sum(p.requires_grad for p in model.parameters()) < len(list(model.parameters()))
