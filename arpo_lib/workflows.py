"""The steps the notebooks and the CLI share: prepare a run, evaluate, summarise, execute notebooks.

Notebooks call these so that they stay lab protocols (no definitions), and the CLI and the tests
go through the same code.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

from arpo_lib import build
from arpo_lib.evaluation.evaluate import EvalResult, evaluate_run
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, run_name_problem
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import read_jsonl, safe_join

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent


NOTEBOOK_PARAMETERS = ("config", "overrides", "run_name")
"""Every notebook's papermill parameters: they map 1:1 onto the run config."""


def check_parameters(namespace: dict[str, Any], allowed: tuple[str, ...] = NOTEBOOK_PARAMETERS) -> None:
    """Fail on a misspelt papermill parameter instead of silently using a default.

    papermill only warns about a parameter the notebook does not declare, and injects it as a
    variable nobody reads. In a freshly started kernel (how papermill and nbval run notebooks),
    the only public names before this call are the parameters, so any other one is a mistake.
    In a kernel where the user already ran other cells, the check cannot tell and stays quiet.
    """
    ip = namespace.get("get_ipython")
    # (papermill and nbval spend one hidden execution; the check cell is the 2nd or 3rd visible one)
    fresh = ip is not None and ip().execution_count <= 5
    if not fresh:
        return
    ignore = {"In", "Out", "get_ipython", "exit", "quit", "open"}
    unknown = sorted(k for k, v in namespace.items() if not k.startswith("_") and k not in ignore
                     and k not in allowed and not isinstance(v, types.ModuleType))
    if unknown:
        raise ValueError(f"unknown notebook parameter(s) {unknown}: this notebook takes {list(allowed)}; "
                         "other settings go into `overrides` as dotted keys, e.g. -p overrides '[\"train.steps=5\"]'")


def use_repo_root() -> Path:
    """Run from the repository root (notebooks live in notebooks/, configs and runs at the top)."""
    if Path.cwd().resolve() != REPO_ROOT:
        os.chdir(REPO_ROOT)
    return REPO_ROOT


def prepare_run(config: str | None, overrides: list[str] | dict[str, Any] | None = None,
                run_name: str | None = None, prefix: str = "run") -> RunConfig:
    """Load a config for a notebook or CLI run; the run name defaults to `<prefix>-<time>`."""
    use_repo_root()
    overrides = list(overrides or []) if not isinstance(overrides, dict) else [f"{k}={v}" for k, v in overrides.items()]
    name = run_name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = build.load_config(config, overrides + [f"name={name}"])
    log.info("run directory: %s", cfg.run_dir)
    return cfg


def evaluate_policy(trainer: Any, label: str, tasks: list[str] | None = None) -> EvalResult:
    """Evaluate the trainer's current policy with the run's eval protocol; writes <run>/eval/<label>
    (and OSWorld's layout beside it, eval.osworld_results)."""
    result = trainer.evaluate(label, tasks)
    export_results(trainer.cfg, safe_join(trainer.run.eval_root, label))
    log.info("evaluation '%s' (%d episodes, %.1f s)\n%s", label, result.episodes, result.seconds, result.table())
    return result


def open_trainer(cfg: RunConfig) -> Any:
    """A Trainer for the run: resumes from its last checkpoint when the run directory exists.
    With train.nproc_per_node > 1 a `LaunchedTrainer`: the run trains in that many processes under
    torchrun, and its `train` streams their progress here (arpo_lib/training/launch.py)."""
    from arpo_lib.training.checkpoint import latest_checkpoint
    from arpo_lib.training.distributed import Ranks
    from arpo_lib.training.launch import LaunchedTrainer

    if cfg.train.nproc_per_node > 1 and not Ranks.under_torchrun():
        launched = LaunchedTrainer(cfg, cfg.train.nproc_per_node)
        log.info("%s on %d processes: %s", cfg.run_dir, cfg.train.nproc_per_node, " ".join(launched.command()))
        return launched
    run = RunDir(cfg.run_dir)
    resume = run.metrics.exists() or latest_checkpoint(run.checkpoints) is not None
    trainer = build.trainer(cfg, resume=resume)
    log.info("%s %s at step %d of %d (%s, %d tasks)", "resuming" if resume else "starting", cfg.run_dir, trainer.step,
             cfg.train.steps, "ARPO" if trainer.replay.enabled else "GRPO", len(cfg.env.tasks))
    return trainer


def print_step(metrics: dict[str, Any]) -> None:
    """A one-line progress report per training step (the trainer's `on_step` callback)."""
    line = (f"step {metrics['step']:>4}  success {metrics['success_rate']:.2f}  reward {metrics['mean_reward']:+.3f}  "
            f"all-failed {metrics['all_failed_groups']:.2f}  injected {metrics['replay_injections']}  "
            f"loss {metrics['loss']:+.4f}  ({metrics['seconds_rollout'] + metrics['seconds_update']:.1f} s)")
    if "eval_success_rate" in metrics:
        line += f"  | eval success {metrics['eval_success_rate']:.2f}"
    log.info(line)


def training_report(trainer: Any) -> str:
    """Final report of a training run: steps, success over time, evaluations, where things are."""
    metrics = read_jsonl(trainer.run.metrics)
    evals = [m for m in metrics if "eval_success_rate" in m]
    lines = [f"run: {trainer.run_dir}", f"steps: {trainer.step} / {trainer.cfg.train.steps}",
             f"replay buffer: {len(trainer.replay)} trajectories over {trainer.replay.stats().get('tasks_with_successes', 0)} tasks, "
             f"{sum(m['replay_injections'] for m in metrics)} injections"]
    if metrics:
        first, last = metrics[0], metrics[-1]
        lines.append(f"train success: first step {first['success_rate']:.2f}, last step {last['success_rate']:.2f}, "
                     f"mean {sum(m['success_rate'] for m in metrics) / len(metrics):.2f}")
    for m in evals:
        lines.append(f"eval at step {m['step']:>4}: success {m['eval_success_rate']:.2f}, pass@k {m['eval_pass_at_k']:.2f}, "
                     f"format errors {m['eval_format_error_rate']:.2f}")
    lines.append(f"checkpoints: {trainer.run.checkpoints}")
    return "\n".join(lines)


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


def eval_dirs(run_dir: str | Path) -> list[Path]:
    """Evaluation directories of a run (each holds results.json), oldest first."""
    found = [p.parent for p in RunDir(Path(run_dir)).eval_root.glob(f"*/{layout.EVAL_RESULTS}")]
    return sorted(found, key=lambda p: (p / layout.EVAL_RESULTS).stat().st_mtime)


def find_eval(path: str | Path) -> Path:
    """An evaluation directory from a path to one, to its results.json, or to a run (its latest)."""
    path = Path(path)
    if path.is_file() and path.name == layout.EVAL_RESULTS:
        return path.parent
    if (path / layout.EVAL_RESULTS).is_file():
        return path
    found = eval_dirs(path)
    if not found:
        raise FileNotFoundError(f"no evaluation (results.json) in {path}")
    return found[-1]


def first_trajectory(eval_dir: str | Path) -> Path:
    """The first episode directory (by domain/task/sample) of an evaluation."""
    metas = sorted(Path(eval_dir).glob(f"*/*/*/{layout.META}"))
    if not metas:
        raise FileNotFoundError(f"no trajectories under {eval_dir}")
    return metas[0].parent


def server_instructions(server: Any) -> str:
    """How to reach a running server, with copy-paste examples (the key by its variable's name,
    never the key), from this machine and from another one."""
    from arpo_lib.run.net import is_loopback

    key_env = server.spec.api_key_env
    auth = f' -H "Authorization: Bearer ${key_env}"' if key_env else ""
    client_key = f", rollout.api_key_env={key_env}" if key_env else ""
    port = server.spec.port
    lines = [f"server pid {server.pid} is healthy at {server.url}"
             + (f" (API key required on /v1: the value of ${key_env})" if key_env else ""),
             f"  OpenAI base URL: {server.base_url}   model name: {server.model}",
             f"  curl {server.url}/health",
             f"  curl{auth} {server.base_url}/models",
             f"  python: serving.chat_completion('{server.base_url}', serving.ui_tars_messages(instruction, [screenshot], []), "
             f"model='{server.model}'{', api_key=os.environ[' + repr(key_env) + ']' if key_env else ''})",
             f"  evaluate with it: ./workbench notebook evaluation "
             f"overrides='[rollout.backend=server, rollout.server_url={server.base_url}{client_key}]'"]
    if is_loopback(server.spec.host):
        lines.append(f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} <user>@<this machine>, then "
                     f"rollout.server_url=http://127.0.0.1:{port}/v1 there (or serve.host=0.0.0.0 with serve.api_key_env)")
    else:
        lines.append(f"  from another machine: rollout.server_url=http://<this machine's address>:{port}/v1"
                     f"{client_key} (export {key_env} there with the same key)")
    lines.append(f"  stop later: serving.stop_server({server.pid})")
    return "\n".join(lines)


def finish_server(server: Any, cfg: RunConfig) -> str:
    """The notebook's last step: stop the server, or leave it running with `serve.keep_running`."""
    if cfg.serve.keep_running:
        return (f"left running (serve.keep_running): pid {server.pid} at {server.base_url}; "
                f"stop it with serving.stop_server({server.pid})")
    server.stop()
    return f"stopped (pid {server.pid}); healthy now: {server.health()}"


def server_smoke_request(server: Any, cfg: RunConfig, task: str | None = None) -> dict[str, Any]:
    """Send the server one UI-TARS turn on a real MiniWoB++ screenshot (greedy); parse the reply."""
    from arpo_lib.actions import ActionParseError, parse_response
    from arpo_lib.agent.client import chat_completion, ui_tars_messages
    from arpo_lib.agent.prompt import coord_mode_for
    from arpo_lib.envs import make_env, split_instance

    task, instance = split_instance(task or cfg.env.tasks[0])
    opts = dict(cfg.env.options)
    with make_env(task, **opts) as env:
        obs, _ = env.reset(seed=cfg.eval.seed if instance is None else instance)
    messages = ui_tars_messages(obs.instruction, [obs.screenshot], [], history_images=cfg.model.history_images,
                                prompt=cfg.agent.prompt)
    from arpo_lib.agent.client import ServerRequestError
    from arpo_lib.serving.launch import api_key_from_env

    key = api_key_from_env(server.spec.api_key_env)
    refused_without_key = None
    if key:  # the key must be what lets a request in
        try:
            chat_completion(server.base_url, messages, model=server.model, temperature=0, max_tokens=1)
            refused_without_key = False
        except ServerRequestError as exc:
            refused_without_key = exc.status == 401
    t0 = time.monotonic()
    reply = chat_completion(server.base_url, messages, model=server.model, temperature=0,
                            max_tokens=cfg.model.max_new_tokens, logprobs=True, api_key=key)
    text = reply["choices"][0]["message"]["content"]
    coord_mode = cfg.model.coord_mode if cfg.model.coord_mode != "auto" else coord_mode_for(cfg.model.path)
    try:
        actions = parse_response(text, obs.screenshot.size, coord_mode=coord_mode).actions
        parsed = True
    except ActionParseError as exc:
        actions, parsed = [], f"no ({exc})"
    return {"task": task, "instruction": obs.instruction, "response": text, "parsed": parsed is True,
            "actions": [a.kind for a in actions], "seconds": round(time.monotonic() - t0, 2),
            "usage": reply.get("usage"), "refused_without_key": refused_without_key}


def run_evaluation(cfg: RunConfig, out_dir: Path) -> EvalResult:
    """Evaluate `cfg.model.path` (or the scripted agent: eval.policy) on the eval tasks (CLI `eval`)."""
    with build.engine(cfg, scripted=cfg.eval.policy == "scripted", protocol=cfg.eval.protocol) as engine:
        result = evaluate_run(engine, cfg, out_dir)
    export_results(cfg, out_dir)
    return result


def export_results(cfg: RunConfig, eval_dir: Path) -> Path | None:
    """With eval.osworld_results, mirror an evaluation into OSWorld's layout (<eval>/osworld_results;
    not <eval>/osworld, which holds the osworld family's own trajectories)."""
    if not cfg.eval.osworld_results:
        return None
    from arpo_lib.evaluation.osworld_export import export_osworld_results

    model = cfg.serve.served_model_name or Path(cfg.model.path).name
    return export_osworld_results(eval_dir, Path(eval_dir) / "osworld_results", model)


def run_task_selection(cfg: RunConfig, out_dir: Path | None = None) -> Any:
    """ARPO's task selection with the base policy (`cfg.select`): k rollouts per task, keep tasks
    with at least `min_successes` successes. Resumable; writes <run>/selection by default."""
    from arpo_lib.evaluation.task_selection import select_tasks

    out_dir = Path(out_dir) if out_dir is not None else RunDir(cfg.run_dir).selection
    with build.engine(cfg) as engine:
        s = cfg.select
        result = select_tasks(engine, s.tasks or cfg.env.tasks, out_dir, k=s.k, min_successes=s.min_successes,
                              seed=s.seed, temperature=s.temperature, max_env_retries=s.max_env_retries,
                              progress=cfg.logging.progress)
    log.info("task selection: kept %d of %d tasks (%.0f s); written to %s", len(result.kept), len(result.tasks),
             result.seconds, out_dir)
    if result.incomplete:
        log.warning("%d task(s) have fewer than k valid episodes (infrastructure failures): %s",
                    len(result.incomplete), result.incomplete[:5])
    return result


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
    trainer.run.summary.write_text(json.dumps(summary, indent=1))
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
    declared = set(papermill.inspect_notebook(str(notebook)))
    unknown = sorted(set(parameters) - declared - {"run_name"})
    if unknown:
        raise ValueError(f"{notebook.name} has no parameter(s) {unknown}; it takes {sorted(declared)}")
    name = run_name or f"{notebook.stem.replace('_test', '')}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = run_name_problem(name)
    if problem:
        raise ValueError(f"run_name: {problem}")
    out = REPO_ROOT / out_dir / name / notebook.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(notebook), str(out), parameters={**parameters, "run_name": name},
                               cwd=str(REPO_ROOT), kernel_name="python3", log_output=True,
                               progress_bar=False)
    return out
