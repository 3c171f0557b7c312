"""The KV cache's storage dtype and the batched prefill's attention kernels, on a GPU.

  python benchmarks/bench_kv_probe.py --shape 2b --out "$OUT"       # writes kv_probe.json (~1 min)
  python benchmarks/bench_kv_probe.py --shape tiny --device cpu --out /tmp/r   # a CPU rehearsal

1. bf16 against fp32 storage of the episodes' keys and values (`CachedGenerator.kv_dtype`): the
   same seeded episodes (3 episodes, 3 KV-cached steps, bf16 autocast) both ways; whether the
   sampled tokens are the same, the largest |log-prob difference|, the bytes each keeps.
2. The batched prefill (several episodes' new turns in one forward, its boolean mask, each
   key/value head attended by its query heads as a broadcast view) with SDPA allowed only its flash, memory-efficient and cuDNN kernels (`torch.nn.attention.sdpa_kernel`):
   it runs (a fast kernel took the mask) or the error says a math fallback was needed.
Random weights of the real shape (benchmarks/common.build_policy), synthetic 1080p screenshots."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import build_policy, device_name, screenshot, write_result  # noqa: E402

from arpo_lib.types import SamplingParams  # noqa: E402


def episodes(policy, n: int, steps: int, size, tokens: int) -> tuple[list, int]:
    convs = [policy.new_conversation(f"Task {i}: open the settings") for i in range(n)]
    out = []
    for step in range(steps):
        for i, c in enumerate(convs):
            c.add_observation(screenshot(100 * i + step, size))
        gens = policy.generate([c.current for c in convs], seeds=[31 * i + step for i in range(n)],
                               cache_keys=list(range(n)), sampling=SamplingParams(temperature=1.0, max_new_tokens=tokens))
        for c, g in zip(convs, gens):
            c.add_response(g.text, g.token_ids, g.logprobs)
        out.append(gens)
    kept = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
               for e in policy.cached.entries.values() for k, v in e.kv)
    policy.cached.clear()
    return out, kept


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2b", choices=["tiny", "tiny25", "2b", "7b"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--resolution", default="1920x1080")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size = tuple(int(v) for v in args.resolution.lower().split("x"))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    policy, _ = build_policy(args.shape, str(device), compute_dtype="bfloat16")  # the GPU's precision, also on the CPU
    policy.cached.prefill_batch_tokens = 10 ** 6  # every row's new turn in one batched prefill
    result: dict = {"benchmark": "kv_probe", "shape": args.shape, "device": device_name(device),
                    "compute_dtype": str(policy.compute_dtype), "screen": list(size)}
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        policy.cached.kv_dtype = dtype
        runs[dtype] = episodes(policy, 3, args.steps, size, args.max_new_tokens)
    (a, bytes32), (b, bytes16) = runs[torch.float32], runs[torch.bfloat16]
    same = all(x.token_ids == y.token_ids for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    gap = max((abs(p - q) for sa, sb in zip(a, b) for x, y in zip(sa, sb) for p, q in zip(x.logprobs, y.logprobs)),
              default=0.0)
    result["kv_dtype"] = {"same_tokens": same, "max_abs_logprob_diff": gap, "fp32_bytes": bytes32,
                          "bf16_bytes": bytes16, "ratio": bytes16 / bytes32 if bytes32 else None}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        policy.cached.kv_dtype = policy.compute_dtype
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                episodes(policy, 3, 2, size, 8)
            result["batched_prefill_fast_kernels"] = {"ok": True}
        except RuntimeError as exc:
            result["batched_prefill_fast_kernels"] = {"ok": False, "error": str(exc).splitlines()[0][:300]}
    else:
        result["batched_prefill_fast_kernels"] = None  # a CUDA question
    print(json.dumps(result, indent=1))
    if args.out:
        write_result("kv_probe", result, args.out)
    return result


if __name__ == "__main__":
    main()
