"""Policy-update benchmark: one trajectory's forward+backward, naive path vs ours, same process.

naive: transformers' per-window vision attention loop, LM head over all trained positions at once
ours:  batched vision window attention, LM head in checkpointed chunks (the trainer's defaults)
Both: fp32 master weights, bf16 autocast on CUDA, SDPA, activation checkpointing (as the issue's
naive measurement). Reported: seconds per fwd+bwd, tokens/s, MFU (FLOP formula in
common.train_flops), peak memory, and the largest log-prob and gradient differences between the
paths. `--update` adds the optimizer step (a complete ARPO update's memory) with `--optimizer`
and `--lora-rank`.

  python benchmarks/bench_update.py --shape 7b --screenshots 15          # on a GPU
  python benchmarks/bench_update.py --shape tiny --screenshots 3 --device cpu   # CPU check
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (build_policy, device_name, peak_flops, peak_gib, reset_peak,  # noqa: E402
                               synthetic_trajectory, table, timed, train_flops, write_result)
from arpo_lib.training.optim import make_optimizer, optimizer_state_bytes  # noqa: E402
from arpo_lib.agent.model.vision_attention import use_batched_vision_attention, use_looped_vision_attention  # noqa: E402

PATHS = {
    "naive": dict(vision="loop", chunk=0),
    "ours": dict(vision="batched", chunk=1024),
}


def set_path(policy, name: str) -> None:
    p = PATHS[name]
    (use_batched_vision_attention if p["vision"] == "batched" else use_looped_vision_attention)(policy.model)
    policy.logprob_chunk = p["chunk"]


def fwd_bwd(policy, segment) -> torch.Tensor:
    policy.model.zero_grad(set_to_none=True)
    logprobs = policy.sequence_logprobs([segment])[0]
    (-logprobs.mean()).backward()
    return logprobs.detach()


def fwd_bwd_many(policy, segments, pack: bool) -> torch.Tensor:
    policy.model.zero_grad(set_to_none=True)
    logprobs = torch.cat(policy.sequence_logprobs(segments, pack=pack))
    (-logprobs.mean()).backward()
    return logprobs.detach()


def packing_rows(policy, size, n: int, device, repeats: int) -> tuple[list[dict], float | None]:
    """n trajectories of 1..n screenshots as one micro-batch: right-padded rows vs one packed row."""
    from arpo_lib.training.optim import padding_fraction

    segments = [synthetic_trajectory(policy, k, size, seed=100 + k) for k in range(1, n + 1)]
    lengths = [len(s) for s in segments]
    rows, outs = [], {}
    for pack in (False, True):
        reset_peak(device)
        name = f"ours, {n} trajectories " + ("packed in 1 row" if pack else "in padded rows")
        try:
            seconds, lp = timed(lambda: fwd_bwd_many(policy, segments, pack), device, repeats)
        except torch.OutOfMemoryError:
            rows.append({"path": name, "status": "out of memory"})
            continue
        outs[pack] = lp.float().cpu()
        rows.append({"path": name, "status": "ok", "s/fwd+bwd": seconds, "tokens/s": sum(lengths) / seconds,
                     "peak GiB": peak_gib(device),
                     "padding": 0.0 if pack else padding_fraction([list(range(n))], lengths)})
    policy.model.zero_grad(set_to_none=True)
    diff = float((outs[False] - outs[True]).abs().max()) if len(outs) == 2 else None
    return rows, diff


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=["tiny", "tiny25", "2b", "7b"])
    ap.add_argument("--screenshots", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--resolution", default=None, help="screenshot WxH (default: 1920x1080 for real shapes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="naive,ours", help="which paths to run, comma-separated")
    ap.add_argument("--update", action="store_true", help="also time a complete update with the optimizer step")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adafactor"])
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16"],
                    help="parameter storage: auto = bf16 for the fwd+bwd comparison of a real shape on CUDA "
                         "(as the issue's naive measurement), fp32 master weights with --update or on the CPU")
    ap.add_argument("--pack", type=int, default=0, metavar="N",
                    help="also compare N trajectories of 1..N screenshots padded vs packed in one row")
    ap.add_argument("--text-layers", type=int, default=None, help="shrink the decoder (a CPU check of a real shape)")
    ap.add_argument("--vision-layers", type=int, default=None, help="shrink the vision tower")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)

    policy, size = build_policy(args.shape, args.device, gradient_checkpointing=not args.no_checkpointing,
                                lora_rank=args.lora_rank, text_layers=args.text_layers,
                                vision_layers=args.vision_layers)
    device = policy.device
    weights = args.weights
    if weights == "auto":
        weights = "bf16" if device.type == "cuda" and args.shape in ("2b", "7b") and not args.update else "fp32"
    if weights == "bf16":
        policy.model.to(torch.bfloat16)
    if args.resolution:
        size = tuple(int(x) for x in args.resolution.lower().split("x"))
    policy.model.train()
    segment = synthetic_trajectory(policy, args.screenshots, size)
    flops = train_flops(policy.model, segment)
    peak = peak_flops(device)
    rows, outputs = [], {}
    for name in args.paths.split(","):
        set_path(policy, name)
        reset_peak(device)
        try:
            seconds, logprobs = timed(lambda: fwd_bwd(policy, segment), device, args.repeats)
        except torch.OutOfMemoryError:
            rows.append({"path": name, "status": "out of memory", "peak GiB": peak_gib(device)})
            policy.model.zero_grad(set_to_none=True)
            continue
        grads = {n: p.grad.detach().float().cpu() for n, p in policy.model.named_parameters() if p.grad is not None}
        outputs[name] = (logprobs.float().cpu(), grads)
        rows.append({"path": name, "status": "ok", "s/fwd+bwd": seconds, "tokens/s": len(segment) / seconds,
                     "MFU": flops["total"] / seconds / peak if peak else None, "peak GiB": peak_gib(device)})
        policy.model.zero_grad(set_to_none=True)
    if "naive" in outputs and "ours" in outputs:
        (lp_a, g_a), (lp_b, g_b) = outputs["naive"], outputs["ours"]
        max_lp = float((lp_a - lp_b).abs().max())
        max_grad = max(float(((g_a[n] - g_b[n]).abs().max() / (g_a[n].abs().max() + 1e-12))) for n in g_a)
        base = next(r for r in rows if r["path"] == "naive")
        for r in rows:
            if r.get("s/fwd+bwd") and base.get("s/fwd+bwd"):
                r["speed-up"] = base["s/fwd+bwd"] / r["s/fwd+bwd"]
    else:
        max_lp = max_grad = None
    pack_diff = None
    if args.pack:
        set_path(policy, "ours")
        pack_rows, pack_diff = packing_rows(policy, size, args.pack, device, args.repeats)
        rows += pack_rows
    update = None
    if args.update:
        set_path(policy, "ours")
        reset_peak(device)
        optimizer = make_optimizer(args.optimizer, policy.trainable_parameters(), lr=1e-6, weight_decay=0.0)

        def step():
            fwd_bwd(policy, segment)
            optimizer.step()

        try:
            seconds, _ = timed(step, device, max(1, args.repeats - 1))
            update = {"optimizer": args.optimizer, "lora_rank": args.lora_rank, "s/update": seconds,
                      "peak GiB": peak_gib(device), "optimizer state GiB": optimizer_state_bytes(optimizer) / 2**30}
        except torch.OutOfMemoryError:
            update = {"optimizer": args.optimizer, "lora_rank": args.lora_rank, "status": "out of memory"}
    result = {
        "benchmark": "update", "device": device_name(device), "shape": args.shape, "screenshots": args.screenshots,
        "tokens": len(segment), "trained_tokens": sum(segment.loss_mask), "image_tokens": sum(segment.mm_token_type_ids),
        "checkpointing": not args.no_checkpointing, "weights": weights, "flops": flops, "peak_flops": peak, "rows": rows,
        "max_abs_logprob_diff": max_lp, "max_rel_grad_diff": max_grad, "update": update,
        "packed_vs_padded_max_logprob_diff": pack_diff, "text_layers": args.text_layers,
        "vision_layers": args.vision_layers,
        "command": "python benchmarks/bench_update.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"{result['device']} | shape {args.shape} | {args.screenshots} screenshots | {len(segment):,} tokens | "
          f"{flops['total'] / 1e12:.1f} TFLOP per fwd+bwd")
    print(table(rows, ["path", "status", "s/fwd+bwd", "speed-up", "tokens/s", "MFU", "peak GiB", "padding"]))
    print(f"max |log-prob naive - ours| = {max_lp}; max relative gradient difference = {max_grad}")
    if update:
        print("complete update:", update)
    shrunk = f"_L{args.text_layers}V{args.vision_layers}" if args.text_layers or args.vision_layers else ""
    path = write_result(f"update_{args.shape}{shrunk}_{args.screenshots}shots" + (f"_pack{args.pack}" if args.pack else "")
                        + (f"_lora{args.lora_rank}" if args.lora_rank else "")
                        + (f"_{args.optimizer}" if args.update else ""), result, args.out)
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
