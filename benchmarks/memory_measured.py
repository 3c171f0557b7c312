"""Per-rank memory of FSDP2 training, MEASURED without a GPU: torch's fake process group in one
process (rank 0 of N; the fake collectives move nothing), every tensor a FakeTensor (shapes and
dtypes, no storage, no arithmetic), and torch's FSDP2 memory tracker counting what exists, by kind,
through the phases of a training step. The code measured is the training code: the model built
from the real shape's config (benchmarks/common.py: REAL_SHAPES), sharded by
`distributed.shard_for_training`, the training forward `HFPolicy.forward_logprobs` (LM head only at
the trained positions, in chunks), the optimizer `make_optimizer` would build on CUDA, activation
checkpointing as `model.gradient_checkpointing` turns it on, a trajectory of N 1080p screenshots
built by the real chat template and image processor, and the push's own loop
(`weight_sync.full_tensors`).

    python benchmarks/memory_measured.py                       # 7B, AdamW + Adafactor, 1/2/4/8/16 ranks (~15 min)
    python benchmarks/memory_measured.py --shapes 7b 2b 32b    # resumable: measured rows are kept
    python benchmarks/memory_measured.py --text-layers 1 --vision-layers 1 --screenshots 1 --resolution 224x224 \
        --out /tmp/m                                           # a quick check (~1 min)

Phases, each its own peak (bytes of rank 0; every rank holds the same):
- start-up: the full fp32 model (the copy each rank still keeps today) and this rank's shards;
- old log-probs: the forward without gradients over one micro-batch (server mode's rollout
  phase on the trainer: generation runs in the vLLM servers' own processes);
- update: forward, backward and the optimizer step over one micro-batch, the optimizer's state
  already there (as from the second step on);
- weight push: every trainable parameter gathered whole, cast to bf16, one at a time.
"full copy" is measured (the fp32 model `model.to_empty` allocates) and resident through every
phase; "without it" subtracts it: what server mode holds once the full copy is gone (issue 35).

What this cannot see (a GPU run can): the CUDA caching allocator's fragmentation and reserve, NCCL's
buffers, CUDA autocast's op list (CPU autocast is measured: the same matmuls in bf16), kernels'
workspaces, and the attention kernel chosen (the CPU flash-attention kernel's shapes are measured).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (RESULTS_DIR, meta_model, synthetic_trajectory, table, tiny_model_dir,  # noqa: E402
                               use_uitars_pixel_limits)

GIB = 2 ** 30
PHASES = ("start-up", "old log-probs", "update", "weight push")
_WARM: set[tuple[str, int]] = set()
"""(shape, world size) measured once with one layer first: the first sharding in a process counts
~2 of the largest parameter more at start-up than every later one (one-time scratch tensors of a
first call, likely DTensor's sharding propagation, cached afterwards). After one warm-up the same
measurement repeats to the byte."""


def trajectory_batch(shape: str, screenshots: int, size: tuple[int, int] = (1920, 1080)) -> dict[str, torch.Tensor]:
    """One training micro-batch: a trajectory of `screenshots` screenshots at `size`, through the
    real chat template and image processor at UI-TARS's pixel limits (a 1080p screenshot is not
    downscaled), padded as `HFPolicy.sequence_logprobs` pads it; plus the index tensors the model
    would derive from it (3D rope positions, vision windows), computed here with the model's own
    functions outside FakeTensorMode, where their data-dependent shapes can be evaluated."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from arpo_lib.agent.hf_policy import HFPolicy, pad_segments

    variant = "qwen25vl" if shape != "2b" else "qwen2vl"
    policy = HFPolicy(tiny_model_dir(variant), device="cpu")
    use_uitars_pixel_limits(policy)
    segment = synthetic_trajectory(policy, screenshots, size)
    batch = pad_segments([segment], policy.pad_id, side="right")
    shell = meta_model(shape)  # its functions, no weights
    grid = batch["image_grid_thw"]
    batch["position_ids"] = shell.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=grid,
        attention_mask=batch["attention_mask"])[0]
    vc = shell.config.vision_config
    batch["cu_seqlens"] = get_vision_cu_seqlens(grid)
    if getattr(vc, "window_size", None):  # Qwen2.5-VL's windowed vision attention
        batch["window_index"], batch["cu_window_seqlens"] = get_vision_window_index(
            grid, spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size)
    batch["suppress_ids"] = policy.suppress_ids
    return batch


@contextlib.contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """Torch's fake process group: this process is rank 0 of `world_size`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """FakeTensorMode in which small integer tensors made `constant` keep their values through
    the operations on them (token ids, grid sizes, window boundaries: the model reads them with
    `.tolist()`), so the model's data-dependent steps run while every large tensor stays fake."""
    import torch._subclasses.fake_tensor as ft

    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = 10 ** 7
    try:
        with ft.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit


class _ScalarsReadAsOne(TorchDispatchMode):
    """Inside FakeTensorMode, a fake tensor's value read on the host (`float(t)`, `.tolist()`) is 1:
    the optimizer's norms (ShardedAdafactor reads each parameter's) scale the update, they do not
    change what is allocated. Only around the optimizer's step; a data-dependent *shape* still fails."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if (func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor)
                and args[0].constant is None):
            return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _training_forward(suppress_ids: Any) -> Any:
    """`HFPolicy.forward_logprobs` as the policy runs it (bf16 autocast, log-probs in chunks of 1024)."""
    from arpo_lib.agent.hf_policy import HFPolicy

    stub = SimpleNamespace(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                           suppress_ids=suppress_ids, logprob_chunk=1024)
    return lambda net, b, targets, temperature: HFPolicy.forward_logprobs(stub, net, b, targets, temperature)


def _fake_batch(mode: Any, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs, target mask) inside `mode`: the pixels fake, the small integer tensors constants."""
    conv = mode.fake_tensor_converter
    fake = {k: (mode.from_tensor(v) if k == "pixel_values" else conv.from_real_tensor(mode, v, make_constant=True))
            for k, v in batch.items()}
    return fake, fake.pop("loss_mask").bool()


def _peak(tracker: Any) -> dict[str, float]:
    """The tracker's peak on the CPU device (where the fake tensors live), by kind, in bytes."""
    snapshot = tracker.get_tracker_snapshot("peak")
    by_kind = next(iter(snapshot.values()))
    return {str(getattr(k, "value", k)): float(v) for k, v in by_kind.items()}


def measure(shape: str, world_size: int, optimizer: str = "adamw", screenshots: int = 15,
            batch: dict[str, torch.Tensor] | None = None, text_layers: int | None = None,
            vision_layers: int | None = None, freeze_vision: bool = False) -> dict[str, Any]:
    """Rank 0's peak bytes in each phase of one training step at `world_size` ranks.
    `batch`: from `trajectory_batch` (made once for several measurements); `text_layers` /
    `vision_layers`: fewer layers of the real widths (a quick check); `freeze_vision`: the vision
    tower not trained (`set_vision_tower_trainable(False)`, as EasyR1's `freeze_vision_tower`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from arpo_lib.agent.hf_policy import enable_activation_checkpointing, set_vision_tower_trainable
    from arpo_lib.agent.model.vision_attention import use_batched_vision_attention
    from arpo_lib.serving.weight_sync import full_tensors
    from arpo_lib.training import distributed as dist_
    from arpo_lib.training.optim import make_optimizer

    t0 = time.monotonic()
    if (shape, world_size) not in _WARM:  # see _WARM
        _WARM.add((shape, world_size))
        measure(shape, world_size, optimizer, 1, batch=trajectory_batch(shape, 1, (224, 224)),
                text_layers=1, vision_layers=1)
    batch = dict(batch if batch is not None else trajectory_batch(shape, screenshots))
    suppress = batch.pop("suppress_ids")
    model = meta_model(shape, text_layers, vision_layers)
    use_batched_vision_attention(model)
    enable_activation_checkpointing(model)
    if freeze_vision:
        set_vision_tower_trainable(model, False)
    forward = _training_forward(suppress)
    phases: dict[str, dict[str, float]] = {}
    with fake_ranks(world_size):
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: it reads a tensor's values
        with fake_tensors() as mode:
            with MemTracker() as startup:
                model.to_empty(device="cpu")  # the full fp32 model every rank keeps today
                model.tie_weights()  # to_empty unties them (2B's LM head is its input embedding)
                net = dist_.shard_for_training(model, forward, compute_dtype=torch.bfloat16, mesh=mesh)
            phases["start-up"] = _peak(startup)
            full_copy = float(sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())))
            params = [p for p in net.parameters() if p.requires_grad]
            if optimizer == "adamw":  # make_optimizer fuses it on CUDA (no temporaries); fused under
                # FakeTensorMode counts its functional outputs as new memory: one parameter at a time here
                opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=False)
            else:
                opt = make_optimizer(optimizer, params, lr=1e-6, weight_decay=0.0)
            for p in params:  # the optimizer's state as after the first step: the steady state is measured
                p.grad = torch.zeros_like(p)
            with _ScalarsReadAsOne():
                opt.step()
            opt.zero_grad(set_to_none=True)
            fake, targets = _fake_batch(mode, batch)

            def tracked() -> Any:
                tracker = FSDPMemTracker(net, opt)  # the full copy is added to these, not tracked
                tracker.track_inputs((fake, targets))
                return tracker

            with tracked() as t, torch.no_grad():
                net(dict(fake), targets, 1.0)
            phases["old log-probs"] = _peak(t)
            net.train()
            with tracked() as t:
                net(dict(fake), targets, 1.0).sum().backward()
                with _ScalarsReadAsOne():
                    opt.step()
                opt.zero_grad(set_to_none=True)
            phases["update"] = _peak(t)
            net.eval()
            trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
            with tracked() as t:
                for _, whole in full_tensors(trainable, torch.device("cpu"), [torch.bfloat16] * len(trainable)):
                    del whole
            phases["weight push"] = _peak(t)
            largest = max(p.numel() for _, p in trainable) * 2
            shards = float(sum(p.to_local().numel() * p.element_size() for p in net.parameters()))
    return {"shape": shape, "text_layers": text_layers, "vision_layers": vision_layers,
            "freeze_vision": freeze_vision, "world_size": world_size, "optimizer": optimizer, "screenshots": screenshots,
            "tokens": int(batch["input_ids"].shape[1]), "patches": int(batch["pixel_values"].shape[0]),
            "full_copy_bytes": full_copy, "shard_bytes": shards, "largest_bf16_param_bytes": float(largest),
            "phases": phases, "seconds": round(time.monotonic() - t0, 1)}


def one_gpu_fwd_bwd(shape: str, batch: dict[str, torch.Tensor]) -> float:
    """Peak bytes of one forward+backward of the whole model in bf16 weights on one device, the run
    `benchmarks/bench_update.py --shape 7b --screenshots 15` measured on an H100 (path `ours`,
    bf16 weights, checkpointing; results/update_7b_15shots.json: 55.84 GiB by
    `torch.cuda.max_memory_allocated`): measured here the same way as the table, it is the check
    of this method against a real GPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from arpo_lib.agent.hf_policy import enable_activation_checkpointing
    from arpo_lib.agent.model.vision_attention import use_batched_vision_attention

    batch = dict(batch)
    forward = _training_forward(batch.pop("suppress_ids"))
    model = meta_model(shape).to(torch.bfloat16)
    use_batched_vision_attention(model)
    enable_activation_checkpointing(model)
    model.train()
    with fake_tensors() as mode, MemTracker() as tracker:
        model.to_empty(device="cpu")
        model.tie_weights()
        fake, targets = _fake_batch(mode, batch)
        logprobs = forward(model, fake, targets, 1.0)
        (-logprobs.mean()).backward()
    return _peak(tracker)["Total"]


def without(result: dict[str, Any], phase: str) -> float:
    """A phase's peak without the full copy (start-up measures it with the shards; the other
    phases' trackers count only the sharded model, its optimizer and what the step allocates)."""
    total = result["phases"][phase]["Total"]
    return total - result["full_copy_bytes"] if phase == "start-up" else total


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows: each phase's peak without the full copy (GiB), the step's peak without it and
    with it (as today)."""
    out = []
    for r in results:
        full = r["full_copy_bytes"]
        what = f"full {r['optimizer']}" + (", vision frozen" if r.get("freeze_vision") else "")
        row = {"shape": r["shape"], "training": what, "ranks": r["world_size"]}
        for phase in PHASES:
            row[phase] = f"{without(r, phase) / GIB:.1f}"
        peak = max(without(r, p) for p in PHASES)
        row["peak without the full copy"] = f"{peak / GIB:.1f} GiB"
        row["peak today (+ full copy)"] = f"{(peak + full) / GIB:.1f} GiB"
        out.append(row)
    return out


def _key(r: dict[str, Any]) -> tuple:
    return (r["shape"], r["world_size"], r["optimizer"], r["screenshots"], r.get("text_layers"),
            r.get("vision_layers"), r.get("resolution"), r.get("freeze_vision", False))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["7b"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "adafactor"], choices=["adamw", "adafactor"])
    ap.add_argument("--screenshots", type=int, default=15)
    ap.add_argument("--resolution", default="1920x1080", help="screenshot size, WxH")
    ap.add_argument("--text-layers", type=int, help="fewer decoder layers (a quick CPU check)")
    ap.add_argument("--vision-layers", type=int, help="fewer vision blocks (a quick CPU check)")
    ap.add_argument("--freeze-vision", action="store_true", help="the vision tower not trained")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory_measured.json"
    # resumable: what the file already holds is kept, and not measured again
    results: list[dict[str, Any]] = json.loads(path.read_text())["results"] if path.is_file() else []
    done = {_key(r) for r in results}
    size = tuple(int(v) for v in args.resolution.lower().split("x"))
    for shape in args.shapes:
        todo = [(o, ws) for o in args.optimizers for ws in args.world_sizes
                if (shape, ws, o, args.screenshots, args.text_layers, args.vision_layers, args.resolution,
                    args.freeze_vision) not in done]
        if not todo:
            continue
        batch = trajectory_batch(shape, args.screenshots, size)
        for optimizer, ws in todo:
            r = measure(shape, ws, optimizer, args.screenshots, batch=batch,
                        text_layers=args.text_layers, vision_layers=args.vision_layers,
                        freeze_vision=args.freeze_vision)
            r["resolution"] = args.resolution
            results.append(r)
            print(f"{shape} {optimizer} x{ws}: peak {max(without(r, p) for p in PHASES) / GIB:.1f} GiB without the "
                  f"full copy ({r['seconds']} s)", flush=True)
            path.write_text(json.dumps({"kind": "measured (FakeTensorMode, fake process group, FSDPMemTracker)",
                                        "command": "python benchmarks/memory_measured.py",
                                        "torch": torch.__version__, "results": results}, indent=1) + "\n")
    order = {"7b": 0, "2b": 1, "32b": 2}
    results.sort(key=lambda r: (order.get(r["shape"], 9), r["shape"], r["optimizer"], bool(r.get("freeze_vision")),
                                r["world_size"]))
    print(table(rows(results), list(rows(results)[0])))
    return {"results": results, "rows": rows(results)}


if __name__ == "__main__":
    main()
