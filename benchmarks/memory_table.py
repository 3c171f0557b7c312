"""Per-GPU memory of the policy update at 1, 2, 8 and 16 GPUs, COMPUTED from the real shapes (not
measured): what `./workbench train --nproc-per-node N` holds before a single activation.

    python benchmarks/memory_table.py            # writes benchmarks/results/memory_computed.json

The parameter counts come from the published configs (benchmarks/common.py: REAL_SHAPES), built on
torch's meta device (no weights, no memory). Per GPU, in bytes, with P parameters:

- one process: fp32 weights 4P, fp32 gradients 4P, AdamW's two moments 8P (Adafactor: factored
  second moments, one row and one column vector per matrix).
- N > 1 processes (FSDP2, arpo_lib/training/distributed.py): weights, gradients and moments /N;
  plus the gathered units in bf16 (the root unit -- embeddings and LM head -- stays gathered for
  the whole forward and backward, and two decoder layers are in flight) and the root's unsharded
  bf16 and fp32 gradients before the reduce-scatter; plus every rank's full model, which
  generates with in-process rollouts (rollout.backend=hf) and computes the old log-probs in
  either mode: 4P (LoRA: its frozen Linear weights in bf16). Adafactor's state is sharded by
  rows; a matrix's column statistics are replicated, so it is counted whole (an upper bound, a
  few MiB).
- LoRA (rank r on q/k/v/o/gate/up/down of the language model): the frozen Linear weights in bf16
  (model.frozen_weights_dtype=auto on CUDA), the rest fp32, only the adapters have gradients and
  moments.
Activations are not counted: they depend on the sequence (15 screenshots at 1080p: ~41.7k tokens)
and on activation checkpointing; the GPU runs (benchmarks/run_gpu.py) measure them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arpo_lib.training.workload import Counts, count  # noqa: E402,F401  (Counts: the tests' import)
from benchmarks.common import REAL_SHAPES, RESULTS_DIR, meta_model, table  # noqa: E402

GIB = 2 ** 30


def per_gpu_bytes(c: Counts, gpus: int, mode: str, lora_rank: int = 16) -> dict[str, float]:
    """Bytes per GPU by part for `mode`: full-adamw, full-adafactor or lora-adamw."""
    n = gpus
    if mode == "lora-adamw":
        adapters = lora_rank * c.lora_per_rank
        weights = 2 * c.text_linear + 4 * (c.total - c.text_linear) + 4 * adapters
        trained, optimizer = adapters, 8 * adapters
    elif mode in ("full-adamw", "full-adafactor"):
        weights, trained = 4 * c.total, c.total
        optimizer = 8 * c.total / n if mode == "full-adamw" else 4 * c.factored
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "lora-adamw":
        optimizer /= n
    parts = {"weights": weights / n, "gradients": 4 * trained / n, "optimizer": optimizer}
    if n > 1:
        gathered = c.root + 2 * c.largest_unit
        parts["gathered units and unreduced root gradients"] = 2 * gathered + (6 * c.root if mode != "lora-adamw" else 0)
        parts["full model for rollouts and old log-probs"] = weights
    return parts


def memory_rows(counts: dict[str, Counts], gpus: tuple[int, ...] = (1, 2, 8, 16)) -> list[dict[str, Any]]:
    """One row per shape and update: total GiB per GPU at each GPU count."""
    rows = []
    for shape, c in counts.items():
        for mode in ("full-adamw", "lora-adamw", "full-adafactor"):
            row: dict[str, Any] = {"shape": shape, "update": mode}
            for n in gpus:
                parts = per_gpu_bytes(c, n, mode)
                replica = parts.get("full model for rollouts and old log-probs", 0.0)
                total = sum(parts.values())
                row[f"{n} GPU"] = (f"{total / GIB:.1f} GiB" if not replica
                                   else f"{(total - replica) / GIB:.1f} GiB (+{replica / GIB:.1f} full copy)")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["7b", "2b"], choices=sorted(REAL_SHAPES))
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    counts = {s: count(meta_model(s)) for s in args.shapes}
    rows = memory_rows(counts)
    result = {"kind": "computed, not measured", "counts": {s: asdict(c) for s, c in counts.items()}, "rows": rows,
              "command": "python benchmarks/memory_table.py"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_computed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows, list(rows[0])))
    return result


if __name__ == "__main__":
    main()
