"""Render benchmarks/results/*.json into benchmarks/RESULTS.md (the README links it).

  python benchmarks/report.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS_DIR, ROOT, table  # noqa: E402

HEADER = """# Benchmark results

Written by `python benchmarks/report.py` from `benchmarks/results/*.json`. Each benchmark runs the
naive path and ours in one process (ratios within one run); the exact command is under each table.
`python benchmarks/run_gpu.py --list` shows the GPU runs, in parts that each fit a 10-minute command. What the paths are:
[bench_update.py](bench_update.py), [bench_rollout.py](bench_rollout.py); the FLOP formula behind MFU
is `train_flops` in [common.py](common.py) (text linears, causal attention, LM head at trained
positions, vision linears and windowed attention; recomputation excluded).

## The levers and where they stand

| lever | where | default | status |
|---|---|---|---|
| KV cache kept per episode, only the new turn prefilled | `arpo_lib/agent/model/kv_generation.py` | on (`model.kv_cache`) | same tokens as re-prefill (tests); CPU figures below |
| log-probs from hidden states in checkpointed chunks | `arpo_lib/agent/model/logprobs.py` | 1024 (`model.logprob_chunk`) | same values and gradients (tests); GPU memory figure to take |
| vision window attention in one SDPA call per window size | `arpo_lib/agent/model/vision_attention.py` | on (`model.vision_attention`) | same values and gradients (tests); GPU speed figure to take |
| micro-batches by token budget | `arpo_lib/training/optim.py` | off (`train.token_budget`) | gradient-exact (per-micro-batch weights) |
| activation checkpointing, every n-th layer | `policy.enable_activation_checkpointing` | off (`model.gradient_checkpointing`, `model.checkpoint_every_n_layers`) | on in the OSWorld configs |
| LoRA (peft) | `arpo_lib/agent/model/lora.py` | off (`model.lora_rank`) | exact resume, merged checkpoints (tests) |
| frozen Linear weights stored in bf16 under LoRA | `arpo_lib/agent/model/lora.py` | auto (`model.frozen_weights_dtype`) | identical outputs and adapter gradients under bf16 autocast (tests) |
| Adafactor | `arpo_lib/agent/model/lora.py` | adamw (`train.optimizer`) | state < 25% of AdamW's on the tiny model (tests) |
| packing several trajectories into one row | `arpo_lib/agent/model/packing.py` | off (`train.pack`) | same log-probs and gradients as padded rows (tests). With SDPA the block-diagonal mask is dense and rules out the flash kernel: on the CPU, 4 tiny trajectories packed took 1.9x longer than padded rows with 22% padding (below). Kept off until a GPU says otherwise; ARPO's long single-trajectory rows carry no padding anyway |
| torch.compile of the decoder layers | `arpo_lib/agent/model/compile.py`, path `ours+compile` | off (benchmarks only) | same log-probs and gradients on the CPU (inductor and aot_eager); GPU figure: `run_gpu.py 4` |
| SDPA backend forced (cuDNN, flash, efficient) | path `ours+cudnn` etc. in bench_update.py | PyTorch's choice | GPU figure: `run_gpu.py 4` |
| selective checkpointing / activation offload | paths `ours+ckptN`, `ours+offload` | every layer | machinery checked on the CPU; at 41.7k tokens an uncheckpointed 7B layer keeps about 8 GB (bf16), so few layers can go without |
"""


def plot_rollout(r: dict, path: Path) -> bool:
    """Per-step prefill tokens and seconds of both paths: the re-prefill cost grows with the
    history, the cached one stays flat."""
    per_step = r.get("per_step")
    if not per_step or any(not v.get("seconds") for v in per_step.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, series in per_step.items():
        steps = range(1, len(series["seconds"]) + 1)
        axes[0].plot(steps, series["prefill_tokens"], marker="o", ms=3, label=name)
        axes[1].plot(steps, series["seconds"], marker="o", ms=3, label=name)
    axes[0].set(xlabel="step", ylabel="prefill tokens (all envs)", title="tokens prefilled per step")
    axes[1].set(xlabel="step", ylabel="seconds", title="generation time per step")
    axes[0].legend()
    fig.suptitle(f"{r['shape']}: {r['envs']} envs x {r['steps']} steps on {r['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


GOALS = """## The goals on a GPU

| goal | measured | status |
|---|---|---|
"""


def goals(gpu: list[dict]) -> str:
    """The GPU goals (speed, MFU, memory, 7B on one GPU) against the GPU results present: met,
    missed, or not measured."""
    def full_shots(r: dict, shape: str) -> bool:
        return (r.get("benchmark") == "update" and r["shape"] == shape and r["screenshots"] >= 15
                and not r.get("text_layers") and not r.get("vision_layers"))

    lines = []
    seven = [r for r in gpu if full_shots(r, "7b")]
    speed = [row["speed-up"] for r in seven if r.get("reference_path") == "naive" for row in r["rows"]
             if row["path"] != "naive" and row.get("speed-up")]
    lines.append(("7B update fwd+bwd at least 3x the naive path",
                  f"{max(speed):.2f}x" if speed else None, max(speed) >= 3 if speed else None))
    # MFU counts the FLOPs a path runs (a frozen vision tower: its forward only); the whole model,
    # as ARPO trains it, is reported beside the best of any path
    mfu = [(row["MFU"], row["path"]) for r in seven for row in r["rows"] if row.get("MFU") and row["path"] != "naive"]
    best = max(mfu) if mfu else None
    whole = max((m for m in mfu if "frozenvision" not in m[1]), default=None)
    shown = f"{best[0]:.1%} ({best[1]})" if best else None
    if whole and best and whole != best:
        shown += f"; training the whole model {whole[0]:.1%} ({whole[1]})"
    lines.append(("7B update at least 40% MFU", shown, best[0] >= 0.40 if best else None))
    two = [r["update"] for r in gpu if full_shots(r, "2b") and (r.get("update") or {}).get("optimizer") == "adamw"
           and not r["update"].get("lora_rank")]
    peak2 = [u["peak GiB"] for u in two if u.get("peak GiB")]
    lines.append(("2B complete update (AdamW) under 40 GB", f"{min(peak2):.1f} GiB" if peak2 else
                  ("out of memory" if two else None), (min(peak2) * 2**30 / 1e9 < 40) if peak2 else (False if two else None)))
    fits = [(u["peak GiB"], u["optimizer"] + (f" ({u['path']})" if u.get("path", "ours") != "ours" else ""),
             u.get("lora_rank")) for r in gpu if full_shots(r, "7b") for u in [r.get("update") or {}]
            if u.get("peak GiB")]
    tried = [r for r in gpu if full_shots(r, "7b") and r.get("update")]
    # an H100 80GB holds 79.6 GiB: a run under 79 GiB fits one (also when it was measured on an H200)
    oom = [u["optimizer"] + (f" LoRA r{u['lora_rank']}" if u.get("lora_rank") else "") + ": out of memory"
           for r in tried for u in [r["update"]] if u.get("status") == "out of memory"]
    lines.append(("a 7B configuration that trains on one 80 GB GPU",
                  "; ".join([f"{o}{f' LoRA r{k}' if k else ''}: {g:.1f} GiB" for g, o, k in fits] + oom) or None,
                  any(g <= 79.0 for g, _, _ in fits) if tried else None))
    rows = [f"| {goal} | {measured or '-'} | {'not measured' if ok is None else ('met' if ok else 'missed')} |"
            for goal, measured, ok in lines]
    return GOALS + "\n".join(rows) + "\n"


def one_gpu_section(r: dict) -> str:
    """A one-GPU config's check (benchmarks/bench_one_gpu.py): each phase measured against the
    planner's prediction, for the config and for the trajectory that ran."""
    cap = f"capped at {r['cap_gib']:g} GiB" if r["cap"]["applied"] else "no memory cap"
    s = r["settings"]
    lines = [f"## One GPU: {r['config']} ({r['shape']}, {cap}) on {r['device']}\n",
             f"One rollout batch ({s['steps']} steps, responses cut at {s['rollout_max_new_tokens']} tokens) and one "
             f"update of {s['trajectories']} trajectories ({s['updates_per_batch']} optimizer steps); peaks by "
             f"{r.get('memory_measured_by', '-')}. Out of memory: "
             + (f"yes, in {r['oom_phase']}" if r["oom"] else "no") + ".\n"]
    rows = [{"phase": p["phase"], "seconds": p.get("seconds"), "measured GiB": p.get("measured_gib"),
             "planned GiB": p.get("predicted_gib"), "measured / planned": p.get("ratio"),
             "planned as run GiB": p["predicted_as_run_bytes"] / 2**30 if p.get("predicted_as_run_bytes") else None,
             "measured / planned as run": p.get("ratio_as_run"), "out of memory": p.get("oom")}
            for p in r.get("phases", [])]
    lines.append(table(rows, ["phase", "seconds", "measured GiB", "planned GiB", "measured / planned",
                              "planned as run GiB", "measured / planned as run", "out of memory"]))
    lines.append(f"\n`{r['command']}`\n")
    return "\n".join(lines)


def main(results_dir: Path = RESULTS_DIR, out: Path = ROOT / "benchmarks" / "RESULTS.md") -> str:
    """RESULTS.md from the update and rollout results in `results_dir` (the memory table and the
    desktop benchmark have their own sections in docs/several-gpus.md and docs/desktop.md)."""
    parts = [HEADER]
    every = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]
    results = [r for r in every if r.get("benchmark") in ("update", "rollout")]
    gpu = [r for r in results if not r["device"].startswith("CPU")]
    if not gpu:
        parts.append("**No GPU figures yet**: every result below was taken on the CPU at tiny sizes (they check\n"
                     "the machinery and the equivalence of the paths; their timings say nothing about a GPU).\n")
    if gpu:
        parts.append(goals(gpu))
    for r in results:
        if r["benchmark"] == "update":
            parts.append(f"## Update: {r['shape']}, {r['screenshots']} screenshots, {r['tokens']:,} tokens "
                         f"({r['trained_tokens']} trained) on {r['device']}\n")
            parts.append(f"{r['flops']['total'] / 1e12:.2f} TFLOP per forward+backward. "
                         f"Activation checkpointing: {r['checkpointing']}. Weights: {r.get('weights', 'fp32')}.\n")
            columns = ["path", "status", "s/fwd+bwd", "speed-up", "tokens/s", "MFU", "peak GiB"]
            columns += [c for c in ("first call s", "max |dlogprob|", "max rel dgrad")
                        if any(row.get(c) is not None for row in r["rows"])]
            parts.append(table(r["rows"], columns))
            if r.get("max_abs_logprob_diff") is not None:
                parts.append(f"\nmax |log-prob difference| {r['max_abs_logprob_diff']:.2g}, "
                             f"max relative gradient difference {r['max_rel_grad_diff']:.2g}")
            if r.get("profile"):
                prof = r["profile"]
                parts.append(f"\nProfile of `{prof['path']}` ({prof['clock']} time, {prof['kernel_ms']:.0f} ms in "
                             f"all, one fwd+bwd of {prof['wall_s']:.2f} s wall):\n")
                parts.append(table(prof["categories"], ["category", "ms", "share"]))
                parts.append("")
                parts.append(table(prof["top"], ["name", "calls", "ms", "share"]))
            if r.get("update"):
                parts.append("\nComplete update (fwd+bwd + optimizer step): " +
                             ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in r["update"].items()))
        else:
            parts.append(f"## Rollout generation: {r['shape']}, {r['envs']} environments x {r['steps']} steps, "
                         f"up to {r['max_new_tokens']} new tokens, on {r['device']}\n")
            parts.append(table(r["rows"], ["path", "s per batch of episodes", "s per step (mean)", "prefill tokens",
                                           "screenshots encoded", "peak GiB"]))
            parts.append(f"\nprefill tokens {r['prefill_reduction']:.1f}x fewer; generation {r['speed_up']:.2f}x "
                         f"faster; same sampled tokens on both paths: {r['same_tokens']}")
            image = f"rollout_{r['shape']}_{r['envs']}x{r['steps']}.png"
            if plot_rollout(r, Path(out).parent / image):
                parts.append(f"\n![per-step prefill tokens and time]({image})")
        parts.append(f"\n`{r['command']}`\n")
    for r in (r for r in every if r.get("benchmark") == "async"):
        parts.append(f"## Asynchronous ARPO against the synchronous loop: {r['setting']}, {r['steps']} steps per arm "
                     f"({r['machine']})\n")
        extra = [key for key in ("env_seconds_per_step", "cpu_idle_fraction") if all(key in a for a in r["arms"])]
        parts.append(table(r["arms"], ["arm", "steps", "wall_s", "steps_per_hour", "env_busy_fraction",
                                       "generator_busy_fraction", *extra, "staleness_max", "seconds_rollout",
                                       "seconds_update"]))
        ratios = "\nsteps per hour over lockstep: " + ", ".join(f"{k} {v:.2f}x"
                                                              for k, v in r["steps_per_hour_ratio"].items())
        lockstep = next((a for a in r["arms"] if a["arm"] == "lockstep"), None)
        if r.get("cpu_bound_speedup") and lockstep is not None:
            ratios += (f"; the most any schedule of lockstep's work could make on these cores: "
                       f"{r['cpu_bound_speedup']:.2f}x (lockstep left {lockstep['cpu_idle_fraction']:.0%} of the CPU idle)")
        parts.append(ratios)
        parts.append(f"\n`{r['command']}` (docs/asynchronous.md)\n")
    for r in (r for r in every if r.get("benchmark") == "async_projection"):
        parts.append(f"## Asynchronous ARPO at GPU scale: a projection ({r['kind']})\n")
        s = r["setting"]
        parts.append(f"{s['envs']} environments, {s['episodes_per_batch']} episodes per batch, {s['batches']} batches; "
                     f"step {s['step_s'][0]}-{s['step_s'][1]} s, reset {s['reset_s'][0]}-{s['reset_s'][1]} s, "
                     f"generation {s['gen_s']} s per step, update {s['update_s']} s per batch\n")
        parts.append(table(r["arms"], ["arm", "steps", "wall_s", "steps_per_hour", "steps_per_hour_ratio",
                                       "env_busy_fraction"]))
        parts.append(f"\n`{r['command']}` (docs/asynchronous.md)\n")
    for r in (r for r in every if r.get("benchmark") == "one_gpu"):
        parts.append(one_gpu_section(r))
    text = "\n".join(parts)
    Path(out).write_text(text)
    print(f"written {out}")
    return text


if __name__ == "__main__":
    main()
