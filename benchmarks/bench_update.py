"""Policy-update benchmark: one trajectory's forward+backward, naive path vs ours, same process.

naive: transformers' per-window vision attention loop, LM head over all trained positions at once
ours:  batched vision window attention, LM head in checkpointed chunks (the trainer's defaults)
Both: fp32 master weights, bf16 autocast on CUDA, SDPA, activation checkpointing (as the naive
baseline is defined). Levers go on top of a path with '+' (`--paths ours,ours+compile,ours+cudnn`:
torch.compile of the decoder layers, checkpointing every N-th layer, activation offload, a forced
SDPA backend); every path is checked against the first one's log-probs and gradients.
Reported: seconds per fwd+bwd (and the first call's, which holds a compile), tokens/s, MFU (FLOP
formula in common.train_flops), peak memory, the differences; `--profile PATH` adds a
torch.profiler summary by kernel category. `--update` adds the optimizer step (a complete ARPO
update's memory, on the last path of `--paths`) with `--optimizer` and `--lora-rank`.

  python benchmarks/bench_update.py --shape 7b --screenshots 15          # on a GPU
  python benchmarks/bench_update.py --shape tiny --screenshots 3 --device cpu   # CPU check
  python benchmarks/run_gpu.py --list                                   # every GPU run, in parts
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (build_policy, device_name, executed_flops, max_rel_grad_diff, peak_flops,  # noqa: E402
                               peak_gib, profile_summary, reset_peak, synthetic_trajectory, table, timed,
                               train_flops, transformers_version, write_result)
from arpo_lib.training.optim import make_optimizer, optimizer_state_bytes  # noqa: E402
from arpo_lib.agent.hf_policy import (disable_activation_checkpointing, enable_activation_checkpointing,  # noqa: E402
                                      set_vision_tower_trainable)
from arpo_lib.agent.model.compile import compile_decoder_layers, is_compiled, uncompile_decoder_layers  # noqa: E402
from arpo_lib.agent.model.vision_attention import use_batched_vision_attention, use_looped_vision_attention  # noqa: E402

BASES = {
    "naive": dict(vision="loop", chunk=0),
    "ours": dict(vision="batched", chunk=1024),
}
MODIFIERS = """a path is a base (naive, ours) and '+'-joined levers on top of it, e.g. ours+compile+ckpt2:
  compile            torch.compile of every decoder layer (--compile-backend; the first call holds the compile)
  ckptN              activation checkpointing of every N-th decoder layer (ckpt0: none) instead of the run's setting
  offload            the checkpointed layers' saved activations in pinned host memory
  frozenvision       the vision module gets no gradient (model.freeze_vision_tower; ARPO trains it)
  flash, efficient, cudnn, math   the only SDPA backend allowed (text and vision attention)"""
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def parse_path(name: str) -> dict:
    base, *levers = name.split("+")
    if base not in BASES:
        raise ValueError(f"path {name!r}: the base must be one of {sorted(BASES)}")
    spec = dict(BASES[base], base=base, compile=False, ckpt=None, offload=False, sdpa=None, frozen_vision=False)
    for lever in levers:
        if lever == "compile":
            spec["compile"] = True
        elif lever == "frozenvision":
            spec["frozen_vision"] = True
        elif lever == "offload":
            spec["offload"] = True
        elif lever in SDPA_BACKENDS:
            spec["sdpa"] = lever
        elif lever.startswith("ckpt") and lever[4:].isdigit():
            spec["ckpt"] = int(lever[4:])
        else:
            raise ValueError(f"path {name!r}: unknown lever {lever!r}\n{MODIFIERS}")
    return spec


def set_path(policy, name: str, checkpointing: int = 1, compile_backend: str = "inductor") -> dict:
    """Put the model in the state of path `name` (undoing any earlier path's levers)."""
    p = parse_path(name)
    (use_batched_vision_attention if p["vision"] == "batched" else use_looped_vision_attention)(policy.model)
    policy.logprob_chunk = p["chunk"]
    every = checkpointing if p["ckpt"] is None else p["ckpt"]
    if every or p["offload"]:
        enable_activation_checkpointing(policy.model, every or 1, offload=p["offload"])
    elif checkpointing or p["ckpt"] is not None:
        disable_activation_checkpointing(policy.model)
    if policy.peft_model is None:  # under LoRA the tower is frozen anyway
        set_vision_tower_trainable(policy.model, not p["frozen_vision"])
    if p["compile"] and not is_compiled(policy.model):
        compile_decoder_layers(policy.model, backend=compile_backend)
    elif not p["compile"] and is_compiled(policy.model):
        uncompile_decoder_layers(policy.model)
    return p


def attention_backend(spec: dict):
    """The SDPA-backend context of a path (nothing forced without a backend lever)."""
    if spec["sdpa"] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[spec["sdpa"]]
    return sdpa_kernel([backend])


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
    ap.add_argument("--paths", default="naive,ours",
                    help="which paths to run, comma-separated; the first is the reference of the speed-ups and "
                         "differences. " + MODIFIERS.replace("%", "%%"))
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile lever")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="one more fwd+bwd of this path under torch.profiler: time by kernel category and the top ops")
    ap.add_argument("--tag", default="", help="appended to the results file name (runs of other paths keep theirs)")
    ap.add_argument("--update", action="store_true", help="also time a complete update with the optimizer step")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adafactor"])
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16"],
                    help="parameter storage: auto = bf16 for the fwd+bwd comparison of a real shape on CUDA "
                         "(as the naive baseline is defined), fp32 master weights with --update or on the CPU")
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
    checkpointing = 0 if args.no_checkpointing else 1
    paths = args.paths.split(",")
    for name in paths + ([args.profile] if args.profile else []):
        parse_path(name)  # every name checked before the first (long) run
    rows, reference = [], None
    for name in paths:
        try:
            spec = set_path(policy, name, checkpointing, args.compile_backend)
        except (ValueError, RuntimeError) as exc:  # e.g. checkpointing every n-th layer on transformers < 5.23
            rows.append({"path": name, "status": f"failed: {str(exc).splitlines()[0][:120]}"})
            continue
        reset_peak(device)
        info: dict = {}
        try:
            with attention_backend(spec):
                seconds, logprobs = timed(lambda: fwd_bwd(policy, segment), device, args.repeats, info=info)
        except torch.OutOfMemoryError:
            rows.append({"path": name, "status": "out of memory", "peak GiB": peak_gib(device)})
            policy.model.zero_grad(set_to_none=True)
            continue
        except RuntimeError as exc:  # e.g. a forced SDPA backend that cannot run these inputs
            if "out of memory" in str(exc).lower():
                raise
            rows.append({"path": name, "status": f"failed: {str(exc).splitlines()[0][:120]}"})
            policy.model.zero_grad(set_to_none=True)
            continue
        ran = executed_flops(flops, spec["frozen_vision"], bool(args.lora_rank))
        row = {"path": name, "status": "ok", "s/fwd+bwd": seconds, "first call s": info.get("first_s"),
               "tokens/s": len(segment) / seconds, "MFU": ran / seconds / peak if peak else None,
               "peak GiB": peak_gib(device)}
        if len(paths) > 1:  # the first path that ran is the reference, kept on the host (off the GPU's peak)
            grads = {n: p.grad.detach().cpu() for n, p in policy.model.named_parameters() if p.grad is not None}
            if reference is None:
                reference = (name, logprobs.float().cpu(), grads)
            else:
                row["max |dlogprob|"] = float((reference[1] - logprobs.float().cpu()).abs().max())
                row["max rel dgrad"] = max_rel_grad_diff(reference[2], grads)
            del grads
        rows.append(row)
        policy.model.zero_grad(set_to_none=True)
    base = rows[0] if rows and rows[0].get("s/fwd+bwd") else None
    for r in rows:
        if base and r.get("s/fwd+bwd"):
            r["speed-up"] = base["s/fwd+bwd"] / r["s/fwd+bwd"]
    ours = next((r for r in rows if r["path"] == "ours" and "max |dlogprob|" in r), None)
    max_lp = ours["max |dlogprob|"] if ours and reference and reference[0] == "naive" else None
    max_grad = ours["max rel dgrad"] if max_lp is not None else None
    reference_path = reference[0] if reference else None
    del reference
    profile = None
    if args.profile:
        spec = set_path(policy, args.profile, checkpointing, args.compile_backend)
        with attention_backend(spec):
            fwd_bwd(policy, segment)  # warm (a compile happens here, not in the trace)
            profile = profile_summary(lambda: fwd_bwd(policy, segment), device)
        profile["path"] = args.profile
        policy.model.zero_grad(set_to_none=True)
    pack_diff = None
    if args.pack:
        set_path(policy, "ours", checkpointing, args.compile_backend)
        pack_rows, pack_diff = packing_rows(policy, size, args.pack, device, args.repeats)
        rows += pack_rows
    update = None
    if args.update:  # with the last path's levers
        spec = set_path(policy, paths[-1], checkpointing, args.compile_backend)
        reset_peak(device)
        optimizer = make_optimizer(args.optimizer, policy.trainable_parameters(), lr=1e-6, weight_decay=0.0)

        def step():  # as the trainer: the last step's gradients freed before the forward
            optimizer.zero_grad(set_to_none=True)
            fwd_bwd(policy, segment)
            optimizer.step()

        try:
            with attention_backend(spec):
                seconds, _ = timed(step, device, max(1, args.repeats - 1))
            update = {"optimizer": args.optimizer, "lora_rank": args.lora_rank, "path": paths[-1], "s/update": seconds,
                      "peak GiB": peak_gib(device), "optimizer state GiB": optimizer_state_bytes(optimizer) / 2**30}
        except torch.OutOfMemoryError:
            update = {"optimizer": args.optimizer, "lora_rank": args.lora_rank, "path": paths[-1],
                      "status": "out of memory"}
    result = {
        "benchmark": "update", "device": device_name(device), "shape": args.shape, "screenshots": args.screenshots,
        "tokens": len(segment), "trained_tokens": sum(segment.loss_mask), "image_tokens": sum(segment.mm_token_type_ids),
        "checkpointing": not args.no_checkpointing, "weights": weights, "flops": flops, "peak_flops": peak, "rows": rows,
        "max_abs_logprob_diff": max_lp, "max_rel_grad_diff": max_grad, "update": update,
        "reference_path": reference_path,
        "packed_vs_padded_max_logprob_diff": pack_diff, "text_layers": args.text_layers,
        "vision_layers": args.vision_layers, "profile": profile, "torch": torch.__version__,
        "transformers": transformers_version(),
        "command": "python benchmarks/bench_update.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"{result['device']} | shape {args.shape} | {args.screenshots} screenshots | {len(segment):,} tokens | "
          f"{flops['total'] / 1e12:.1f} TFLOP per fwd+bwd")
    print(table(rows, ["path", "status", "s/fwd+bwd", "first call s", "speed-up", "tokens/s", "MFU", "peak GiB",
                       "max |dlogprob|", "max rel dgrad", "padding"]))
    print(f"max |log-prob naive - ours| = {max_lp}; max relative gradient difference = {max_grad}")
    if update:
        print("complete update:", update)
    if profile:
        print(f"profile of {profile['path']} ({profile['clock']} time):")
        print(table(profile["categories"], ["category", "ms", "share"]))
        print(table(profile["top"], ["name", "calls", "ms", "share"]))
    shrunk = f"_L{args.text_layers}V{args.vision_layers}" if args.text_layers or args.vision_layers else ""
    path = write_result(f"update_{args.shape}{shrunk}_{args.screenshots}shots" + (f"_pack{args.pack}" if args.pack else "")
                        + (f"_lora{args.lora_rank}" if args.lora_rank else "")
                        + (f"_{args.optimizer}" if args.update else "") + (f"_{args.tag}" if args.tag else ""),
                        result, args.out)
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
