"""The steps the notebooks and the CLI share: prepare a run, evaluate, summarise, execute notebooks.

Notebooks call these so that they stay lab protocols (no definitions), and the CLI and the tests
go through the same code.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from arpo_lib.config import RunConfig, load_config
from arpo_lib.evaluate import EvalResult, evaluate

REPO_ROOT = Path(__file__).resolve().parent.parent


def prepare_run(config: str | None, overrides: list[str] | dict[str, Any] | None = None,
                run_name: str | None = None, prefix: str = "run") -> RunConfig:
    """Load a config for a notebook or CLI run; the run name defaults to `<prefix>-<time>`."""
    overrides = list(overrides or []) if not isinstance(overrides, dict) else [f"{k}={v}" for k, v in overrides.items()]
    name = run_name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = load_config(config, overrides + [f"name={name}"])
    print(f"run directory: {cfg.run_dir.resolve()}")
    return cfg


def evaluate_policy(trainer: Any, label: str, tasks: list[str] | None = None) -> EvalResult:
    """Evaluate the trainer's current policy with the run's eval protocol; writes <run>/eval/<label>."""
    cfg = trainer.cfg
    out = cfg.run_dir / "eval" / label
    result = evaluate(trainer.engine(), tasks or cfg.eval.tasks or cfg.env.tasks,
                      samples_per_task=cfg.eval.samples_per_task, temperature=cfg.eval.temperature,
                      seed=cfg.eval.seed, out_dir=out, progress=cfg.logging.progress, description=f"eval {label}")
    print(f"evaluation '{label}' ({result.episodes} episodes, {result.seconds:.1f} s)")
    print(result.table())
    return result


def run_evaluation(cfg: RunConfig, out_dir: Path) -> EvalResult:
    """Evaluate `cfg.model.path` on the eval tasks (CLI `eval`)."""
    from arpo_lib.envs.worker import EnvPool
    from arpo_lib.policy import HFPolicy
    from arpo_lib.rollout import RolloutEngine

    policy = HFPolicy(cfg.model.path, device=cfg.model.device, compute_dtype=cfg.model.compute_dtype,
                      coord_mode=cfg.model.coord_mode, history_images=cfg.model.history_images,
                      max_new_tokens=cfg.model.max_new_tokens)
    opts = dict(cfg.env.options)
    opts.setdefault("max_steps", cfg.env.max_steps)
    with EnvPool(cfg.env.workers, opts, timeout_s=cfg.env.step_timeout_s,
                 cache_size=cfg.env.envs_per_worker) as pool:
        engine = RolloutEngine(policy, pool, max_steps=cfg.env.max_steps, format_coef=cfg.algo.format_coef,
                               format_penalty=cfg.algo.format_penalty)
        return evaluate(engine, cfg.eval.tasks or cfg.env.tasks, samples_per_task=cfg.eval.samples_per_task,
                        temperature=cfg.eval.temperature, seed=cfg.eval.seed, out_dir=out_dir,
                        progress=cfg.logging.progress)


def print_metrics(history: list[dict[str, Any]]) -> None:
    """One line per training step."""
    keys = ["step", "success_rate", "mean_reward", "all_failed_groups", "replay_injections", "loss",
            "clip_fraction", "grad_norm", "seconds_rollout", "seconds_update"]
    print("  ".join(f"{k:>12}" for k in keys))
    for m in history:
        print("  ".join(f"{m[k]:>12.4g}" if isinstance(m[k], float) else f"{m[k]:>12}" for k in keys))


class MemoryMonitor:
    """Samples the memory of this process and all its children (browsers, workers).

    Sums PSS (proportional set size): browser processes share most of their pages, and summing
    RSS would count those many times over."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        me = psutil.Process(os.getpid())
        total = 0
        for proc in [me] + me.children(recursive=True):
            try:
                total += proc.memory_full_info().pss
            except (psutil.Error, AttributeError):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(self.interval_s)

    def start(self) -> "MemoryMonitor":
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop sampling; returns the peak in GB."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_bytes / 1e9


def smoke_summary(trainer: Any, before: EvalResult, after: EvalResult, history: list[dict[str, Any]],
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
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    rows = [f"{'':<2}{k:<26} {v}" for k, v in summary.items()]
    return "Smoke run summary\n" + "\n".join(rows)


def execute_notebook(notebook: str | Path, parameters: dict[str, Any], run_name: str | None = None,
                     out_dir: str | Path = "runs") -> Path:
    """Execute a notebook headlessly with papermill; the executed copy goes into the run directory."""
    import logging

    import papermill

    # Stream the cells' output while the notebook runs (papermill logs it at INFO).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    pm_logger = logging.getLogger("papermill")
    if not pm_logger.handlers:
        pm_logger.addHandler(handler)
    pm_logger.setLevel(logging.INFO)
    pm_logger.propagate = False
    notebook = REPO_ROOT / notebook
    name = run_name or f"{notebook.stem.replace('_test', '')}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = REPO_ROOT / out_dir / name / notebook.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(notebook), str(out), parameters={**parameters, "run_name": name},
                               cwd=str(REPO_ROOT), kernel_name="python3", log_output=True,
                               progress_bar=False)
    return out
