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
phase; "without it" subtracts it: what server mode holds once the full copy is gone (the 7B-on-8-GPUs preparation).

What this cannot see (a GPU run can): the CUDA caching allocator's fragmentation and reserve, NCCL's
buffers, CUDA autocast's op list (CPU autocast is measured: the same matmuls in bf16), kernels'
workspaces, and the attention kernel chosen (the CPU flash-attention kernel's shapes are measured).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arpo_lib.training.memory_model import (GIB, PHASES, measure_fwd_bwd, measure_step,  # noqa: E402
                                            with_index_tensors)
from benchmarks.common import (RESULTS_DIR, meta_model, synthetic_trajectory, table, tiny_model_dir,  # noqa: E402
                               use_uitars_pixel_limits)

_WARM: set[tuple[str, int]] = set()
"""(shape, world size) measured once with one layer first: the first sharding in a process counts
~2 of the largest parameter more at start-up than every later one (one-time scratch tensors of a
first call, likely DTensor's sharding propagation, cached afterwards). After one warm-up the same
measurement repeats to the byte."""


def trajectory_batch(shape: str, screenshots: int, size: tuple[int, int] = (1920, 1080)) -> dict[str, torch.Tensor]:
    """One training micro-batch: a trajectory of `screenshots` screenshots at `size`, through the
    real chat template and image processor at UI-TARS's pixel limits (a 1080p screenshot is not
    downscaled), padded as `HFPolicy.sequence_logprobs` pads it; plus the index tensors the model
    would derive from it (arpo_lib/training/memory_model.py: `with_index_tensors`)."""
    from arpo_lib.agent.hf_policy import HFPolicy, pad_segments

    variant = "qwen25vl" if shape != "2b" else "qwen2vl"
    policy = HFPolicy(tiny_model_dir(variant), device="cpu")
    use_uitars_pixel_limits(policy)
    segment = synthetic_trajectory(policy, screenshots, size)
    batch = with_index_tensors(pad_segments([segment], policy.pad_id, side="right"), meta_model(shape))
    batch["suppress_ids"] = policy.suppress_ids
    return batch


def measure(shape: str, world_size: int, optimizer: str = "adamw", screenshots: int = 15,
            batch: dict[str, torch.Tensor] | None = None, text_layers: int | None = None,
            vision_layers: int | None = None, freeze_vision: bool = False) -> dict[str, Any]:
    """Rank 0's peak bytes in each phase of one training step at `world_size` ranks
    (`memory_model.measure_step` on the shape's meta model).
    `batch`: from `trajectory_batch` (made once for several measurements); `text_layers` /
    `vision_layers`: fewer layers of the real widths (a quick check); `freeze_vision`: the vision
    tower not trained (`set_vision_tower_trainable(False)`, as EasyR1's `freeze_vision_tower`)."""
    t0 = time.monotonic()
    if (shape, world_size) not in _WARM:  # see _WARM
        _WARM.add((shape, world_size))
        measure(shape, world_size, optimizer, 1, batch=trajectory_batch(shape, 1, (224, 224)),
                text_layers=1, vision_layers=1)
    batch = batch if batch is not None else trajectory_batch(shape, screenshots)
    r = measure_step(meta_model(shape, text_layers, vision_layers), batch, world_size, optimizer, freeze_vision)
    return {"shape": shape, "text_layers": text_layers, "vision_layers": vision_layers,
            "freeze_vision": freeze_vision, "world_size": world_size, "optimizer": optimizer, "screenshots": screenshots,
            "tokens": r["tokens"], "patches": r["patches"], "full_copy_bytes": r["full_copy_bytes"],
            "shard_bytes": r["shard_bytes"], "largest_bf16_param_bytes": r["largest_bf16_param_bytes"],
            "phases": r["phases"], "seconds": round(time.monotonic() - t0, 1)}


def one_gpu_fwd_bwd(shape: str, batch: dict[str, torch.Tensor]) -> float:
    """Peak bytes of one forward+backward of the whole model in bf16 weights on one device, the run
    `benchmarks/bench_update.py --shape 7b --screenshots 15` measured on an H100 (path `ours`,
    bf16 weights, checkpointing; results/update_7b_15shots.json: 55.84 GiB by
    `torch.cuda.max_memory_allocated`): measured here the same way as the table, it is the check
    of this method against a real GPU."""
    return measure_fwd_bwd(meta_model(shape), batch)


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
    ap.add_argument("--gpu-check", action="store_true",
                    help="only the check against the H100: one fwd+bwd of the whole 7B in bf16 on one device "
                         "(writes memory_measured_gpu_check.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.gpu_check:
        size = tuple(int(v) for v in args.resolution.lower().split("x"))
        t0 = time.monotonic()
        measured = one_gpu_fwd_bwd("7b", trajectory_batch("7b", args.screenshots, size)) / GIB
        h100 = next(r for r in json.loads((RESULTS_DIR / "update_7b_15shots.json").read_text())["rows"]
                    if r["path"] == "ours")["peak GiB"]
        record = {"kind": "measured (FakeTensorMode) against the H100's torch.cuda.max_memory_allocated",
                  "command": "python benchmarks/memory_measured.py --gpu-check", "torch": torch.__version__,
                  "shape": "7b", "screenshots": args.screenshots, "fake_gib": round(measured, 2),
                  "h100_gib": round(h100, 2), "ratio": round(measured / h100, 3),
                  "seconds": round(time.monotonic() - t0, 1)}
        (out / "memory_measured_gpu_check.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"fake {measured:.1f} GiB, H100 {h100:.1f} GiB: {measured / h100:.3f}x")
        return record
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
