"""Training on several processes (GPUs, or CPU processes with gloo): PyTorch's FSDP2 plus the
bookkeeping that makes N ranks compute the update one process would.

    torchrun --nproc-per-node 2 -m arpo_lib train ...      (./workbench train --nproc-per-node 2)

What each rank holds and does (rollout.backend=hf, the in-process mode):
- the policy's full model (`HFPolicy.model`), used for generation: no collective inside
  generation, so episodes of different lengths never have to run in lockstep (rank 0 reads the
  checkpoint, the others build an `empty_model` and receive it: `broadcast_model`);
- a sharded copy for the update (`shard_for_training`, built on the meta device and filled from the
  full model, so no second whole copy is ever made: every text decoder layer and vision block
  its own FSDP2 unit, the rest in the root unit; bf16 compute with fp32 reduction on CUDA), whose
  optimizer state is sharded too, and which computes the update's "old" log-probs on the update's
  own micro-batch plan (`backend.FSDP2.old_logprobs`); after each update its trained weights are
  gathered back into the full model one parameter at a time (`sync_full_model`);
- its share of the episodes (`requests[rank::world]`), written to the shared run directory and
  gathered to every rank in request order, so every rank forms the same groups with the same
  seeded replay buffer (rank 0 alone writes records; in a checkpoint every rank writes its
  optimizer shard with torch.distributed.checkpoint, rank 0 the rest: training/checkpoint.py);
- its share of each mini-batch's sequences, balanced by tokens (`split_by_tokens`), with the loss
  normaliser of the WHOLE mini-batch (every rank knows it: all ranks hold the batch), scaled by
  the world size because FSDP averages gradients over ranks. N ranks therefore take the same
  optimizer step as one process, up to float summation order.

With model servers (rollout.backend=server, full fine-tuning) no rank generates, so none keeps the
full model once training starts: it goes to the meta device, and the push to the servers, the
model directory they load and each checkpoint's model are gathered from the shards one parameter
at a time, every rank taking part (`full_weights`, `join_full_weights`, `gather_to_host`;
`backend.FSDP2` with keep_full_model=False).

FSDP2 all-gathers inside every forward, so all ranks must run the same number of forwards: a rank
with fewer micro-batches than the busiest runs the shortest sequence with its loss times 0.

Where rank 0 works alone (the warm start, a push it leads), the others wait on the
gloo control group, whose timeout is long, never in an NCCL collective, and they raise as soon as
rank 0 fails (`on_main`, `WeightPass`) instead of at a timeout (NCCL's: 30 minutes).

This module holds the low-level pieces; the trainer reaches them through `training.backend.FSDP2`.

Multi-node: the run directory must be on storage every node sees (ranks read each other's
trajectory directories for replay); gloo and NCCL are told which network interface reaches the
master node (`socket_interface_env`, set by the launch).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from arpo_lib.agent.model.logprobs import LogprobNet

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes (torchrun's environment variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: Any = field(default=None, compare=False, repr=False)
    """The process group of the control traffic (objects, sums, barriers, the weight pass's
    announcements, torch.distributed.checkpoint's planning), gloo: a side group on GPUs
    (`init_process_group` returns the ranks carrying it), None for the default group (gloo on
    the CPU)."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @staticmethod
    def under_torchrun() -> bool:
        """Whether this process is one of torchrun's (which must not start torchrun again)."""
        return "LOCAL_RANK" in os.environ

    @classmethod
    def from_env(cls) -> "Ranks":
        return cls(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)))


SINGLE = Ranks()


COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
"""NCCL's collectives (FSDP2's all-gathers and gradient reductions, all in lockstep): a rank that
died or hung is noticed within this."""
CONTROL_TIMEOUT = datetime.timedelta(hours=2)
"""Objects, sums of metrics and barriers (the control traffic): a slow OSWorld episode keeps the
others waiting at a rollout batch's or an evaluation's gather, and rank 0's warm start keeps them
waiting, for this long."""

class RankFailed(RuntimeError):
    """Raised on the other ranks when rank 0 failed in work they were waiting for."""


def init_process_group(ranks: Ranks, device: torch.device) -> Ranks:
    """Join the process group unless already in one; returns `ranks` carrying the control group
    (what every collective of this module then goes on). On GPUs: NCCL for the training
    collectives (`COLLECTIVE_TIMEOUT`) and a gloo side group for objects, sums and barriers
    (`CONTROL_TIMEOUT`; CPU tensors and pickles never go through NCCL and GPU memory). On the CPU
    one gloo group carries both, with the long timeout."""
    import torch.distributed as dist

    if not ranks.distributed or dist.is_initialized():
        return ranks
    if device.type == "cuda":
        torch.cuda.set_device(ranks.local_rank)
        dist.init_process_group("nccl", rank=ranks.rank, world_size=ranks.world_size, timeout=COLLECTIVE_TIMEOUT)
        return replace(ranks, control=dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world_size, timeout=CONTROL_TIMEOUT)
    return replace(ranks, control=None)


def device_for(ranks: Ranks, device: str) -> str:
    """`model.device` for this rank: one GPU per process (cuda:LOCAL_RANK)."""
    if ranks.distributed and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{ranks.local_rank}"
    return device


# -- the sharded model ---------------------------------------------------------------------------
def shard_for_training(model: torch.nn.Module, forward_fn: Any, *, compute_dtype: torch.dtype,
                       mesh: Any = None) -> LogprobNet:
    """A sharded copy of `model` for the update: each text decoder layer and each vision block
    its own FSDP2 unit, the rest in the root. Parameters stay fp32 (the master weights); with a
    16-bit `compute_dtype` (CUDA's default; `model.compute_dtype` on the CPU) the forward runs in it
    and gradients are reduced in fp32.

    No second copy of the model is made: the copy's structure is built with its parameters on the
    meta device, sharded there, and only this rank's shards are allocated and filled from
    `model` (`load_full_into_sharded`: every rank slices its own part, nothing is sent).
    `mesh`: the device mesh to shard over (default: every rank, on the model's device type; the
    measured memory table passes one made before it enters FakeTensorMode)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    on_meta = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
               for p in model.parameters()}
    net = LogprobNet(copy.deepcopy(model, memo=on_meta), forward_fn)  # buffers are copied: they are small
    mp = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:  # CUDA's default (bf16); on the CPU only when asked for
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # the mesh names the model's device: FSDP2's default mesh takes the machine's accelerator, so
    # gloo ranks on CPU would each claim cuda:LOCAL_RANK on a machine with fewer GPUs than ranks
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in shard_units(net.net):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    net.to_empty(device=device)  # this rank's shards (and the buffers, refilled below)
    load_full_into_sharded(model, net)
    return net


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers and vision blocks of a Qwen2-VL / Qwen2.5-VL model (any wrapping, e.g.
    PEFT's, is looked through): each becomes its own FSDP unit."""
    units = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith(("language_model.layers", "visual.blocks")):
            units.extend(module)
    if not units:
        raise ValueError(f"{type(model).__name__}: no decoder layers or vision blocks found to shard")
    return units


def sync_full_model(sharded: LogprobNet, full: torch.nn.Module) -> None:
    """The sharded trainable weights (every rank takes part) into each rank's full model, one
    parameter at a time: each is gathered (`DTensor.full_tensor`), copied into the full model's
    and freed before the next, so the sync needs one parameter's memory above the shards, not a
    whole second model (a full state dict: 31 GB more per rank at 7B). Frozen parameters never
    change and are not gathered."""
    from torch.distributed.tensor import DTensor

    targets = dict(full.named_parameters())
    trainable = {n for n, p in targets.items() if p.requires_grad}
    seen = set()
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            if not param.requires_grad:
                continue
            key = _full_name(name)
            if key not in targets:
                raise RuntimeError(f"sharded and full model differ: the full model has no parameter {key}")
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            targets[key].copy_(whole)
            del whole
            seen.add(key)
    if trainable - seen:
        raise RuntimeError(f"sharded and full model differ: not trained in the shards: {sorted(trainable - seen)[:3]}")


def full_weights(sharded: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name in the full model, parameter) of every parameter of the shards, in the same order on
    every rank; DTensors not yet gathered. A pass over them that rank 0 consumes while every other
    rank takes part in each gather is a `WeightPass`: the server-mode path, where no rank keeps a
    full copy of the model."""
    return [(_full_name(name), param) for name, param in sharded.named_parameters()]


_GO, _STOP = 1, 0
"""What rank 0 announces before each gather of a `WeightPass`."""


class WeightPass:
    """Rank 0's pass over the shards' weights (a push to the servers, a saved model), which every
    other rank joins gather for gather (`join_full_weights`). `weights` is what rank 0 hands its
    consumer (`agent.model.shards.full_tensors` gathers each in its turn): the shards under
    their full-model names, each of whose `full_tensor()` first announces the gather over the
    control group. After a failure on rank 0 between two gathers (a server that stops answering
    mid-push), `stop` tells the others, and they raise `RankFailed` at once instead of waiting in
    the next gather until NCCL's timeout (30 minutes) or rank 0's exit. A rank 0 that hangs
    rather than fails keeps them waiting (on gloo) until its own timeout ends the hang.

    Cost: one broadcast of one integer on gloo per parameter (some 700 at 7B)."""

    def __init__(self, sharded: torch.nn.Module, ranks: Ranks):
        self.ranks = ranks
        entries = full_weights(sharded)
        self.weights: list[tuple[str, Any]] = [(name, _Announced(param, self)) for name, param in entries]
        self.total, self.gathered, self.stopped = len(entries), 0, False

    @property
    def open(self) -> bool:
        """The other ranks may be waiting for the next gather's announcement."""
        return not self.stopped and self.gathered < self.total

    def gather(self, param: torch.Tensor) -> torch.Tensor:
        """`param` whole: announced, then gathered with every rank."""
        from torch.distributed.tensor import DTensor

        if not self.open:  # the others joined for exactly `total` gathers
            raise RuntimeError(f"this pass over the weights is over ({self.gathered} of {self.total} gathered)")
        _announce(self.ranks, _GO)
        self.gathered += 1
        with torch.no_grad():
            return param.full_tensor() if isinstance(param, DTensor) else param

    def stop(self, error: str = "rank 0 stopped (its log says why)") -> bool:
        """Rank 0, after a failure: the ranks waiting for the next gather raise, with `error` (rank 0's
        exception as text), which follows the stop on the same channel. Best effort (the others may
        be gone already: then nothing waits); idempotent. Returns whether the others were told."""
        if not self.open:
            return False
        self.stopped = True
        try:
            _announce(self.ranks, _STOP)
            broadcast_object(error, self.ranks)
        except Exception as exc:  # rank 0 is failing already: its own error is the one to see
            log.warning("could not tell the other ranks that the pass over the weights stopped: %s", exc)
        return True


class _Announced:
    """One of a `WeightPass`'s shards as rank 0's consumer sees it: the DTensor's attributes
    (shape, dtype), and a `full_tensor()` that the other ranks are told of first."""

    def __init__(self, param: torch.Tensor, weights_pass: WeightPass):
        self._param, self._pass = param, weights_pass

    def full_tensor(self) -> torch.Tensor:
        return self._pass.gather(self._param)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not the shard's internals (and no recursion before __init__ ran)
            raise AttributeError(name)
        return getattr(self._param, name)


def _announce(ranks: Ranks, signal: int | None = None) -> int:
    """Rank 0's `signal` on every rank (the control group)."""
    import torch.distributed as dist

    box = torch.tensor([signal if ranks.is_main else -1], dtype=torch.int64)
    dist.broadcast(box, src=0, group=ranks.control)
    return int(box.item())


def join_full_weights(sharded: torch.nn.Module, ranks: Ranks) -> None:
    """A rank other than 0: its part in rank 0's `WeightPass`, the same gathers in the same order,
    each dropped at once; raises `RankFailed` when rank 0 stops the pass."""
    from torch.distributed.tensor import DTensor

    entries = full_weights(sharded)
    with torch.no_grad():
        for done, (_, param) in enumerate(entries):
            if _announce(ranks) == _STOP:
                error = broadcast_object(None, ranks)  # what `WeightPass.stop` sends after the stop
                raise RankFailed(f"rank 0 failed during its pass over the weights ({done} of {len(entries)} "
                                 f"gathered): {error}")
            if isinstance(param, DTensor):
                param.full_tensor()  # this rank's part; the whole tensor is dropped at once


def gather_to_host(weights: WeightPass) -> dict[str, torch.Tensor]:
    """Every weight of the pass whole, in host memory, by full-model name (rank 0 writing the model
    without a full copy on the device): one parameter gathered on the device at a time. The other
    ranks call `join_full_weights`; they are released if this fails."""
    try:
        return {name: w.full_tensor().detach().to("cpu", copy=True) for name, w in weights.weights}
    except BaseException as exc:
        weights.stop(describe(exc))
        raise


def describe(exc: BaseException) -> str:
    """An exception as the other ranks are told of it."""
    return f"{type(exc).__name__}: {exc}"


# -- splitting the work --------------------------------------------------------------------------
def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of `lengths` per rank, longest first to the least-loaded rank (ties: lower rank):
    deterministic, so every rank computes every rank's share. Each share keeps the input order."""
    load = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def gather_objects(mine: list[T], ranks: Ranks) -> list[list[T]]:
    """Every rank's list, on every rank (pickled over the process group)."""
    import torch.distributed as dist

    if not ranks.distributed:
        return [mine]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, mine, group=ranks.control)
    return out


def interleave(per_rank: list[list[T]]) -> list[T]:
    """Undo `items[rank::world]`: the shares of `gather_objects` back in the original order."""
    world = len(per_rank)
    total = sum(len(p) for p in per_rank)
    return [per_rank[i % world][i // world] for i in range(total)]


def all_reduce_sum(values: Sequence[float], ranks: Ranks) -> list[float]:
    """Element-wise sum of `values` over ranks (float64)."""
    import torch.distributed as dist

    if not ranks.distributed:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, group=ranks.control)
    return t.tolist()


def barrier(ranks: Ranks) -> None:
    import torch.distributed as dist

    if ranks.distributed:
        dist.barrier(group=ranks.control)


def load_full_into_sharded(full: torch.nn.Module, sharded: LogprobNet) -> None:
    """Copy the full model's weights and buffers into the shards (at start-up, and after the warm
    start, which rank 0 trained and `broadcast_model` handed to every rank). Every rank holds the
    same full model, so each slices its own shard of each parameter: nothing is sent, and no
    full state dict is made."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params, buffers = dict(full.named_parameters()), dict(full.named_buffers())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            source = params[_full_name(name)].detach()
            if isinstance(param, DTensor):
                source = distribute_tensor(source.to(param.device), param.device_mesh, param.placements,
                                           src_data_rank=None)
            param.copy_(source)
        for name, buffer in sharded.named_buffers():
            buffer.copy_(buffers[_full_name(name)])


def _full_name(sharded_name: str) -> str:
    """A parameter's name in the full model, from its name in the `LogprobNet` wrapper."""
    return sharded_name[len("net."):] if sharded_name.startswith("net.") else sharded_name


def load_full_optimizer_state(sharded: LogprobNet, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard a whole optimizer state keyed by parameter name (a one-process checkpoint's, via
    `checkpoint.optimizer_state_by_name`, or one gathered by earlier versions) onto this group's ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(sharded, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def broadcast_object(obj: T, ranks: Ranks) -> T:
    """Rank 0's `obj` on every rank."""
    import torch.distributed as dist

    if not ranks.distributed:
        return obj
    box = [obj if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ranks.control)
    return box[0]


def on_main(work: Callable[[], T], ranks: Ranks, open_pass: Callable[[], "WeightPass | None"] = lambda: None) -> T | None:
    """`work()` on rank 0 while the other ranks wait for it on the control group (gloo, its long
    timeout: rank 0's work may outlast NCCL's); they get None. When `work` raises on rank 0 the
    others raise `RankFailed` at once, with its error, rather than at their next collective when
    it times out or rank 0 has exited; rank 0 raises its own.

    `open_pass`: rank 0's pass over the weights that the others may be joining while `work` runs (a
    push to the servers). When `work` fails with that pass open (before its first gather or mid-way)
    the others are waiting for the pass's next announcement, not here: the pass is stopped with the
    error, which they read there."""
    if not ranks.distributed:
        return work()
    result, failure = None, None
    if ranks.is_main:
        try:
            result = work()
        except BaseException as exc:
            failure = exc
            weights = open_pass()
            if weights is not None and weights.stop(describe(exc)):
                raise
    try:
        error = broadcast_object(None if failure is None else describe(failure), ranks)
    except Exception:
        if failure is None:
            raise
        error = None  # the others are gone: rank 0's own error is the one to see
    if failure is not None:
        raise failure
    if error is not None:
        raise RankFailed(f"rank 0 failed while the others waited for it: {error}")
    return result


def broadcast_model(model: torch.nn.Module, ranks: Ranks) -> None:
    """Rank 0's weights and buffers into every rank's copy of `model`, in place, the buffers no
    checkpoint holds too (the rotary embeddings' `inv_freq`: an `empty_model` has garbage there).
    Every rank first waits at the control group's barrier: rank 0 comes from work it did alone
    (reading the checkpoint, the warm start: up to hours), and that wait must be on gloo's long
    timeout, not in an NCCL broadcast whose watchdog aborts the waiting ranks after
    `COLLECTIVE_TIMEOUT`."""
    import torch.distributed as dist

    if not ranks.distributed:
        return
    barrier(ranks)
    sent: set[int] = set()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in sent:  # a tied embedding once
                sent.add(id(tensor))
                dist.broadcast(tensor.detach(), src=0)


def empty_model(path: str, device: torch.device | str) -> torch.nn.Module:
    """`path`'s network, fp32, its memory allocated on `device` and nothing read but the config:
    what a rank other than 0 builds while rank 0 reads the checkpoint, for `broadcast_model` to
    fill. The checkpoint is read once per run instead of once per rank (at 7B, 8 ranks on a node
    held 8 x 30.9 GiB of host memory while loading, and read the checkpoint 8 times)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty keeps the tie; said again so no version of either library can lose it
    with contextlib.suppress(OSError):  # the checkpoint's, as from_pretrained sets it (some have none)
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def close_process_group(ranks: Ranks) -> None:
    """Leave the process group (after a barrier, so no rank leaves while another still needs it).
    Objects no longer referenced (an FSDP2 module the caller dropped) are freed first: left to
    the interpreter's exit, a process that had run FSDP2 on gloo aborted at exit ('terminate
    called without an active exception') in about 1 run in 6 on 2 busy cores; 0 in 30 after."""
    import gc

    import torch.distributed as dist

    if ranks.distributed and dist.is_initialized():
        gc.collect()
        dist.barrier(group=ranks.control)
        dist.destroy_process_group()  # every group, the side group too


ABANDON_TIMEOUT_S = 10.0
"""How long a failed rank gives the process group's teardown before it exits anyway."""


def abandon_process_group(ranks: Ranks, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
    """Leave the process group without waiting for the other ranks: this one failed, and they may
    be in a collective it will never join (torchrun stops them when it exits). Left to the
    interpreter's exit, a gloo group aborted the process there ('terminate called without an active
    exception', SIGABRT) in about 1 failed run in 10 on 2 busy cores, and torchrun then named that
    signal as the first failure instead of the rank's own error. The teardown runs on a thread given
    `timeout_s`: a collective this rank left in flight must not hold its exit."""
    import gc
    import threading

    import torch.distributed as dist

    if not (ranks.distributed and dist.is_initialized()):
        return
    gc.collect()

    def teardown() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group already broken: the exit is what matters now
            log.warning("leaving the process group after a failure: %s", exc)

    worker = threading.Thread(target=teardown, name="abandon-process-group", daemon=True)
    worker.start()
    worker.join(timeout_s)


# -- several nodes -------------------------------------------------------------------------------
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def socket_interface_env(master_addr: str, environ: Mapping[str, str],
                         interfaces: Mapping[str, str] | None = None) -> dict[str, str]:
    """The socket interface variables for a run on several nodes that `environ` leaves unset: the
    interface this node reaches `master_addr` through. Without GLOO_SOCKET_IFNAME gloo binds to
    whatever address the hostname resolves to (often 127.0.1.1 or a management network the other
    nodes cannot reach), and the control group's first collective waits for `CONTROL_TIMEOUT`.
    Empty when the interface cannot be found (logged: set the variables by hand).
    `interfaces`: name -> IPv4 address (default: this machine's)."""
    unset = [v for v in SOCKET_IFNAME_VARIABLES if not environ.get(v)]
    if not unset:
        return {}
    name = interface_towards(master_addr, interfaces)
    if name is None:
        log.warning("no network interface found that reaches %s: set %s to the one the nodes talk over",
                    master_addr, " and ".join(unset))
        return {}
    return {v: name for v in unset}


def interface_towards(host: str, interfaces: Mapping[str, str] | None = None) -> str | None:
    """The network interface holding the local address a connection to `host` leaves from (on
    the master node itself: the interface of its own address, which the others reach it at);
    None when `host` does not resolve or no interface holds that address."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect sends nothing: the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    table = ipv4_interfaces() if interfaces is None else interfaces
    return next((name for name, addr in table.items() if addr == local), None)


def ipv4_interfaces() -> dict[str, str]:
    """This machine's network interfaces with an IPv4 address: name -> address (the primary one of
    each; Linux's SIOCGIFADDR ioctl)."""
    import fcntl
    import struct

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this one
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out

