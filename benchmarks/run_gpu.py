"""Every GPU figure of the speed and memory goals, in parts that each end inside a 10-minute command.

  python benchmarks/run_gpu.py --list                      # the parts, their steps and time estimates
  python benchmarks/run_gpu.py 1 --out "$OUT"              # part 1 on the GPU (results + log into $OUT)
  python benchmarks/run_gpu.py all --rehearse --out /tmp/r # every step shrunk, on the CPU (tests do this)
  python benchmarks/run_gpu.py all --rehearse --real-shapes --out /tmp/r   # at the real widths (~15 min)

A part runs its steps in order (most needed first), each a subprocess with a timeout, and starts a
step only when the part's remaining time covers the step's estimate: a part never outruns its
deadline (default 9 minutes), and what ran is in `$OUT` (one JSON per step, `part<N>.log`,
`part<N>_status.json`), at most 8 files per part. Then, in the checkout
the results go to: copy the JSON into benchmarks/results/ and run `python benchmarks/report.py`.

The estimates are minutes measured on an H100 on 2026-11-25 (benchmarks/results/h100_logs/), rounded
up; the steps not run that day (2B Adafactor, 7B Adafactor with the tower frozen) are guesses. The parts
(the recipe is in docs/speed-and-memory.md, "Running the benchmarks on a GPU machine without network"):
  part 1  update fwd+bwd naive vs ours, 7B and 2B, 15 screenshots (goal: 3x, 40% MFU); 2B with half
          the layers checkpointed and with cuDNN attention
  part 2  complete updates: 2B AdamW and Adafactor (goal < 40 GB), 7B LoRA AdamW, 7B Adafactor with the
          vision tower frozen (goal: fits 80 GB; full Adafactor ran out of memory); the GPU tests
  part 3  rollouts 2B 8 x 15 KV-cached vs re-prefill
  part 4  levers for the 7B update: torch.compile, SDPA backends, frozen vision, a profile (if goals are missed)
  part 5  the one-GPU truth probe: what the machine's Python has (benchmarks/probe_imports.py: the
          transformers the offload lever needs: carry its wheel where the machine's is older), then the
          one-GPU configs against the planner (benchmarks/bench_one_gpu.py): configs/one_gpu_24gb.yaml
          (2B LoRA r16) capped at 22.0 GiB (an L4) and configs/one_gpu_40gb.yaml (7B LoRA r16, 15
          screenshots) at 38.5 GiB (an A100-40GB's usable), random weights, 128-token responses, one
          rollout batch and one update each: per phase the allocated and reserved peaks, seconds, the
          host syncs of generation, a summary of the live blocks after it, pinned host bytes, the LoRA
          merge; then bf16 against fp32 KV storage and the batched prefill under the fast SDPA kernels
          only (benchmarks/bench_kv_probe.py). Not run on a GPU yet: its estimates are guesses (from the
          H100 runs of parts 1-3: a 7B LoRA update of 41.8k tokens 9.6 s, a 2B 8 x 15 rollout 89 s)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, estimated minutes on an H100, argv after `python`)
PARTS: dict[str, list[tuple[str, float, list[str]]]] = {
    "1": [
        ("update_7b", 4.5, ["benchmarks/bench_update.py", "--shape", "7b", "--screenshots", "15", "--repeats", "2"]),
        ("update_2b", 1.5, ["benchmarks/bench_update.py", "--shape", "2b", "--screenshots", "15", "--repeats", "2"]),
        ("levers_2b", 1.5, ["benchmarks/bench_update.py", "--shape", "2b", "--screenshots", "15", "--repeats", "2",
                            "--paths", "ours,ours+ckpt2,ours+cudnn", "--tag", "levers"]),
    ],
    "2": [
        ("update_2b_adamw", 1.2, ["benchmarks/bench_update.py", "--shape", "2b", "--screenshots", "15", "--paths", "ours",
                                  "--repeats", "2", "--update", "--optimizer", "adamw"]),
        ("update_2b_adafactor", 1.2, ["benchmarks/bench_update.py", "--shape", "2b", "--screenshots", "15",
                                      "--paths", "ours", "--repeats", "2", "--update", "--optimizer", "adafactor"]),
        ("update_7b_lora16_adamw", 1.3, ["benchmarks/bench_update.py", "--shape", "7b", "--screenshots", "15",
                                         "--paths", "ours", "--repeats", "2", "--update", "--optimizer", "adamw",
                                         "--lora-rank", "16"]),
        ("update_7b_adafactor_frozenvision", 2.0, ["benchmarks/bench_update.py", "--shape", "7b", "--screenshots", "15",
                                                   "--paths", "ours+frozenvision", "--repeats", "2", "--update",
                                                   "--optimizer", "adafactor", "--tag", "frozenvision"]),
        ("gpu_tests", 2.0, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/agent/model/test_gpu.py",
                            "tests/agent/model/test_shards.py", "tests/training/test_distributed_gpu.py"]),
    ],
    "3": [
        ("rollout_2b", 7.5, ["benchmarks/bench_rollout.py", "--shape", "2b", "--envs", "8", "--steps", "15",
                             "--max-new-tokens", "48"]),
    ],
    "4": [
        ("levers_7b_compile", 3.5, ["benchmarks/bench_update.py", "--shape", "7b", "--screenshots", "15", "--repeats", "2",
                                    "--paths", "ours,ours+compile", "--profile", "ours", "--tag", "compile"]),
        ("levers_7b_sdpa_vision", 5.0, ["benchmarks/bench_update.py", "--shape", "7b", "--screenshots", "15",
                                        "--repeats", "2", "--paths", "ours,ours+cudnn,ours+flash,ours+frozenvision",
                                        "--tag", "sdpa_vision"]),
    ],
    "5": [  # guesses, never run on a GPU (module docstring); the import probe first: what the rest needs
        ("imports", 0.2, ["benchmarks/probe_imports.py"]),
        ("one_gpu_24gb", 3.0, ["benchmarks/bench_one_gpu.py", "--config", "configs/one_gpu_24gb.yaml",
                               "--cap-gb", "22.0", "--shape", "2b"]),
        ("one_gpu_40gb", 4.0, ["benchmarks/bench_one_gpu.py", "--config", "configs/one_gpu_40gb.yaml",
                               "--cap-gb", "38.5", "--shape", "7b"]),
        ("kv_probe", 0.8, ["benchmarks/bench_kv_probe.py", "--shape", "2b"]),
    ],
}

# What a rehearsal puts after each benchmark's arguments (later flags win in argparse): one
# screenshot, one repeat, on the device the real command would pick (`auto`: the CPU here, as
# the GPU run's own default, so a rehearsal runs the GPU run's device handling); the shapes swapped for the tiny models of the same
# architectures (seconds), or with `real_shapes` kept at their real widths with one layer each
# (minutes: a 7B-wide step takes ~1.5 min on 2 cores).
REHEARSAL = {
    "benchmarks/bench_update.py": ["--screenshots", "1", "--repeats", "1", "--compile-backend", "aot_eager"],
    "benchmarks/bench_rollout.py": ["--envs", "2", "--steps", "2", "--max-new-tokens", "4"],
    # 8 steps (past the 40 GB config's 5 screenshots kept: segments restart), two trajectories
    "benchmarks/bench_one_gpu.py": ["--resolution", "224x224", "--steps", "8", "--trajectories", "2",
                                    "--max-new-tokens", "4"],
    "benchmarks/bench_kv_probe.py": ["--resolution", "224x224", "--steps", "2", "--max-new-tokens", "4"],
    "benchmarks/probe_imports.py": [],
}
REAL_SHAPES_SHRUNK = ["--text-layers", "1", "--vision-layers", "1", "--resolution", "224x224"]
TINY_OF = {"2b": "tiny", "7b": "tiny25"}


def step_command(argv: list[str], out: Path, rehearse: bool, real_shapes: bool = False) -> list[str]:
    cmd = [sys.executable, *argv]
    if argv[0] in REHEARSAL:
        cmd += ["--out", str(out)]
        if rehearse:
            cmd += REHEARSAL[argv[0]]
            if real_shapes:
                cmd += REAL_SHAPES_SHRUNK
            else:
                cmd = [TINY_OF.get(a, a) if cmd[i - 1] == "--shape" else a for i, a in enumerate(cmd)]
    return cmd


def run_part(part: str, out: Path, deadline_s: float, rehearse: bool, real_shapes: bool = False) -> list[dict]:
    """Run one part's steps under its deadline; returns their status rows (also written to `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"part{part}.log"
    start = time.monotonic()
    statuses = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "a") as log:
        def say(text: str) -> None:
            print(text, flush=True)
            log.write(text + "\n")
            log.flush()

        for name, minutes, argv in PARTS[part]:
            left = deadline_s - (time.monotonic() - start)
            if not rehearse and left < minutes * 60:
                statuses.append({"step": name, "status": f"skipped: {left:.0f} s left, estimate {minutes * 60:.0f} s"})
                say(f"[run_gpu] {name}: skipped ({left:.0f} s left in the part, estimated {minutes:.1f} min)")
                continue
            cmd = step_command(argv, out, rehearse, real_shapes)
            say(f"[run_gpu] {name} (estimate {minutes:.1f} min, {left:.0f} s left): {' '.join(cmd[1:])}")
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # the output loop below ends when the step is killed (a rehearsal gives each step the whole deadline)
            timer = threading.Timer(deadline_s if rehearse else max(1.0, left), proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    if "USDT:" in line or "gpuGetDeviceCount" in line:  # the profiler's CPU-only chatter
                        continue
                    print(line, end="", flush=True)
                    log.write(line)
                proc.wait()
            finally:
                timed_out = not timer.is_alive() and proc.returncode != 0
                timer.cancel()
            status = "timed out" if timed_out else ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
            seconds = time.monotonic() - t0
            statuses.append({"step": name, "status": status, "seconds": round(seconds, 1), "estimate_s": minutes * 60})
            say(f"[run_gpu] {name}: {status} in {seconds:.0f} s")
    (out / f"part{part}_status.json").write_text(json.dumps(statuses, indent=1) + "\n")
    return statuses


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", choices=[*PARTS, "all"])
    ap.add_argument("--list", action="store_true", help="print the parts and their steps")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds a part may take (default 9 min)")
    ap.add_argument("--rehearse", action="store_true", help="every step shrunk to run on the CPU (tiny models)")
    ap.add_argument("--real-shapes", action="store_true",
                    help="with --rehearse: the 2B/7B widths with one layer each instead of the tiny models")
    args = ap.parse_args(argv)
    if args.list or not args.part:
        for part, steps in PARTS.items():
            total = sum(m for _, m, _ in steps)
            print(f"part {part} (about {total:.1f} min on an H100):")
            for name, minutes, step in steps:
                print(f"  {name:24s} {minutes:4.1f} min  python {' '.join(step)}")
        return []
    statuses = []
    for part in (PARTS if args.part == "all" else [args.part]):
        statuses += run_part(part, Path(args.out), args.deadline, args.rehearse, args.real_shapes)
    return statuses


if __name__ == "__main__":
    statuses = main()
    sys.exit(0 if all(s["status"] in ("ok",) or s["status"].startswith("skipped") for s in statuses) else 1)
