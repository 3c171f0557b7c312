"""What a notebook prints at its end: the smoke run's summary (also written to
<run>/summary.json), and the seed-determined digests of a run that nbval compares between
executions (wall-clock numbers left out)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import read_jsonl

if TYPE_CHECKING:
    from arpo_lib.evaluation.evaluate import EvalResult
    from arpo_lib.training.trainer import Trainer
    from arpo_lib.workflows.memory import MemoryMonitor


def smoke_summary(trainer: "Trainer", before: EvalResult, after: EvalResult, history: list[dict[str, Any]],
                  started: float, memory: MemoryMonitor | None = None) -> dict[str, Any]:
    """The smoke run's summary (printed and written to <run>/summary.json)."""
    rollout_s = sum(m["seconds_rollout"] for m in history)
    update_s = sum(m["seconds_update"] for m in history)
    eval_s = before.seconds + after.seconds
    env_steps = sum(m["env_steps"] for m in history) + before.env_steps + after.env_steps
    total_s = time.monotonic() - started
    summary = {
        "run_dir": str(trainer.run_dir),
        "algorithm": "ARPO" if trainer.replay.enabled else "GRPO",
        "tasks": trainer.cfg.env.tasks,
        "warm_start_steps": trainer.cfg.warm_start.steps,
        "train_steps": trainer.step,
        "success_before": before.success_rate,
        "success_after": after.success_rate,
        "eval_temperature": trainer.cfg.eval.temperature,
        "eval_episodes": after.episodes,
        "train_success_per_step": [round(m["success_rate"], 3) for m in history],
        "replay_injections": sum(m["replay_injections"] for m in history),
        "replay_size": len(trainer.replay),
        "final_loss": history[-1]["loss"] if history else None,
        "env_steps": env_steps,
        "env_steps_per_s": env_steps / max(rollout_s + eval_s, 1e-9),
        "seconds_total": round(total_s, 1),
        "seconds_warm_start": round(trainer.seconds_warm_start, 1),
        "seconds_rollout": round(rollout_s, 1),
        "seconds_update": round(update_s, 1),
        "seconds_eval": round(eval_s, 1),
        "peak_memory_gb": round(memory.stop(), 2) if memory else None,
        "env_errors": sum(m["env_errors"] for m in history) + before.env_errors + after.env_errors,
    }
    trainer.run.summary.write_text(json.dumps(summary, indent=1))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The smoke run's summary: success before -> after RL and the training curve on top, then
    every number as aligned rows (what the notebook and `workbench smoke` print)."""
    before, after = summary["success_before"], summary["success_after"]
    head = [f"success before -> after RL: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points; "
            f"{summary.get('eval_episodes', '?')} episodes each at temperature {summary.get('eval_temperature', '?')}, "
            "the same episodes before and after)",
            "training-rollout success per step: " + " ".join(f"{x:.2f}" for x in summary["train_success_per_step"])]
    rows = [f"{'':<2}{k:<26} {v}" for k, v in summary.items()]
    return "Smoke run summary\n" + "\n".join(head + rows)


def smoke_seeds_table(summaries: list[dict[str, Any]], min_gain: float = 0.10) -> tuple[str, bool]:
    """`workbench smoke --seeds`: one row per seed (success before -> after, the gain, the
    training curve) and whether every seed gained at least `min_gain`."""
    lines = ["", "| seed | before | after | gain | training success per step | seconds |", "|---|---|---|---|---|---|"]
    gains = []
    for s in summaries:
        gain = s["success_after"] - s["success_before"]
        gains.append(gain)
        curve = " ".join(f"{x:.2f}" for x in s["train_success_per_step"])
        lines.append(f"| {s['seed']} | {s['success_before']:.3f} | {s['success_after']:.3f} | "
                     f"{100 * gain:+.1f} pts{'' if gain >= min_gain else ' (short)'} | {curve} | {s['seconds_total']} |")
    every = bool(gains) and all(g >= min_gain for g in gains)
    lines.append(f"\nEvery seed gained at least {100 * min_gain:.0f} points: {'yes' if every else 'NO'} "
                 f"({sum(g >= min_gain for g in gains)} of {len(gains)}; mean gain {100 * sum(gains) / max(len(gains), 1):+.1f} points)")
    return "\n".join(lines), every


def deterministic_digest(summary: dict[str, Any]) -> str:
    """The seed-determined numbers of a run, rounded (what nbval compares between executions)."""
    keys = ["algorithm", "train_steps", "success_before", "success_after", "train_success_per_step",
            "replay_injections", "eval_success_per_eval"]
    out = []
    for k in keys:
        if k not in summary:
            continue
        v = summary[k]
        if isinstance(v, float):
            v = round(v, 2)
        elif isinstance(v, list):
            v = [round(x, 2) for x in v]
        out.append(f"{k}: {v}")
    return "\n".join(out)


def run_digest(run_dir: str | Path) -> dict[str, Any]:
    """Seed-determined numbers of a training run directory (for `deterministic_digest`)."""
    from arpo_lib.run.config import load_config

    run = RunDir(Path(run_dir))
    cfg = load_config(run.config)
    metrics = read_jsonl(run.metrics)
    return {
        "algorithm": "ARPO" if cfg.algo.replay.enabled else "GRPO",
        "train_steps": len(metrics),
        "train_success_per_step": [m["success_rate"] for m in metrics],
        "replay_injections": sum(m["replay_injections"] for m in metrics),
        "eval_success_per_eval": [m["eval_success_rate"] for m in metrics if "eval_success_rate" in m],
    }

