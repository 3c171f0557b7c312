"""Rollout-generation benchmark: N environments x S steps, re-prefill path vs KV-cached path.

re-prefill: every step runs the whole conversation so far through the model (all screenshots
            again), as the original ARPO rollout loop does
kv-cached:  each episode keeps its KV cache; a step prefills only its new turn (arpo_lib/agent/model/
            kv_generation.py, the default of HFPolicy in rollouts)
Both sample with the same per-episode seeds, so they must produce the same tokens; the benchmark
checks it. Screenshots are synthetic (random pixels) at the shape's resolution; responses are
whatever the (random or tiny) model samples, cut at --max-new-tokens.

  python benchmarks/bench_rollout.py --shape 7b --envs 8 --steps 15      # on a GPU
  python benchmarks/bench_rollout.py --shape tiny --envs 3 --steps 4 --device cpu
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (build_policy, device_name, peak_gib, reset_peak, screenshot, sync,  # noqa: E402
                               table, write_result)
from arpo_lib.types import SamplingParams  # noqa: E402


def generate_rows(policy, segments, seeds, max_new_tokens, keys, rows_per_call: int):
    """Generate for all rows, `rows_per_call` at a time (0 = all in one batch). Per-row seeds make
    the samples independent of the grouping."""
    step = rows_per_call or len(segments)
    out = []
    for i in range(0, len(segments), step):
        out += policy.generate(segments[i:i + step], sampling=SamplingParams(max_new_tokens=max_new_tokens),
                               seeds=seeds[i:i + step], cache_keys=keys[i:i + step] if keys else None)
    return out


def run_episodes(policy, envs: int, steps: int, size, max_new_tokens: int, cached: bool, device) -> dict:
    convs = [policy.new_conversation(f"Task {i}: open the settings") for i in range(envs)]
    prefill = 0
    policy.cached.stats.clear()
    per_step, tokens, prefill_per_step = [], [], []
    rows_per_call, fallback_from = 0, None
    for step in range(steps):
        for i, conv in enumerate(convs):
            conv.add_observation(screenshot(1000 * i + step, size))
        segments = [c.current for c in convs]
        before = prefill if not cached else policy.cached.stats["prefill_tokens"]
        if not cached:
            prefill += sum(len(s) for s in segments)
        sync(device)
        start = time.perf_counter()
        seeds = [7919 * i + step for i in range(envs)]
        keys = list(range(envs)) if cached else None
        try:
            gens = generate_rows(policy, segments, seeds, max_new_tokens, keys, rows_per_call)
        except torch.OutOfMemoryError:
            if cached or rows_per_call == 1:
                raise
            # Re-prefilling the whole history of every env in one batch outgrew the GPU: go on one
            # env at a time (and say so) rather than lose the comparison.
            torch.cuda.empty_cache()
            rows_per_call, fallback_from = 1, step
            gens = generate_rows(policy, segments, seeds, max_new_tokens, keys, rows_per_call)
        sync(device)
        per_step.append(time.perf_counter() - start)
        prefill_per_step.append((prefill if not cached else policy.cached.stats["prefill_tokens"]) - before)
        for conv, g in zip(convs, gens):
            conv.add_response(g.text, g.token_ids, g.logprobs)
        tokens.append([g.token_ids for g in gens])
    for i in range(envs):
        policy.release(i)
    if cached:
        prefill = policy.cached.stats["prefill_tokens"]
    images = envs * steps * (steps + 1) // 2 if not cached else policy.cached.stats["images_encoded"]
    return {"seconds": sum(per_step), "per_step": per_step, "prefill_tokens": prefill, "images_encoded": images,
            "final_tokens": sum(len(c.current) for c in convs), "tokens": tokens,
            "one_env_at_a_time_from_step": fallback_from, "prefill_per_step": prefill_per_step}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=["tiny", "tiny25", "2b", "7b"])
    ap.add_argument("--envs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--resolution", default=None, help="screenshot WxH (default: 1920x1080 for real shapes)")
    ap.add_argument("--text-layers", type=int, default=None, help="shrink the decoder (a CPU check of a real shape)")
    ap.add_argument("--vision-layers", type=int, default=None, help="shrink the vision tower")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)

    policy, size = build_policy(args.shape, args.device, text_layers=args.text_layers,
                                vision_layers=args.vision_layers)
    device = policy.device
    if args.resolution:
        size = tuple(int(x) for x in args.resolution.lower().split("x"))
    results = {}
    for name, cached in (("re-prefill", False), ("kv-cached", True)):
        reset_peak(device)
        with torch.no_grad():
            try:
                results[name] = run_episodes(policy, args.envs, args.steps, size, args.max_new_tokens, cached, device)
                results[name]["peak GiB"] = peak_gib(device)
            except torch.OutOfMemoryError:
                results[name] = {"status": "out of memory", "peak GiB": peak_gib(device)}
    a, b = results["re-prefill"], results["kv-cached"]
    same = a.get("tokens") == b.get("tokens") if "tokens" in a and "tokens" in b else None
    rows = []
    for name, r in results.items():
        rows.append({"path": name, "s per batch of episodes": r.get("seconds"),
                     "s per step (mean)": (r["seconds"] / args.steps) if "seconds" in r else None,
                     "prefill tokens": r.get("prefill_tokens"), "screenshots encoded": r.get("images_encoded"),
                     "peak GiB": r.get("peak GiB")})
    ratio = (a["prefill_tokens"] / b["prefill_tokens"]) if "prefill_tokens" in b and b["prefill_tokens"] else None
    speedup = (a["seconds"] / b["seconds"]) if "seconds" in a and "seconds" in b else None
    result = {"benchmark": "rollout", "device": device_name(device), "shape": args.shape, "envs": args.envs,
              "steps": args.steps, "max_new_tokens": args.max_new_tokens, "rows": rows,
              "prefill_reduction": ratio, "speed_up": speedup, "same_tokens": same,
              "final_context_tokens": b.get("final_tokens"),
              "re_prefill_one_env_at_a_time_from_step": a.get("one_env_at_a_time_from_step"),
              "per_step": {name: {"seconds": r.get("per_step"), "prefill_tokens": r.get("prefill_per_step")}
                           for name, r in results.items()},
              "command": "python benchmarks/bench_rollout.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"{result['device']} | shape {args.shape} | {args.envs} envs x {args.steps} steps")
    print(table(rows, ["path", "s per batch of episodes", "s per step (mean)", "prefill tokens",
                       "screenshots encoded", "peak GiB"]))
    print(f"prefill tokens {ratio:.1f}x fewer, generation {speedup:.2f}x faster, same tokens: {same}")
    if a.get("one_env_at_a_time_from_step") is not None:
        print(f"re-prefill ran out of memory batched and went on one env at a time from step "
              f"{a['one_env_at_a_time_from_step']}")
    path = write_result(f"rollout_{args.shape}_{args.envs}x{args.steps}", result, args.out)
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
