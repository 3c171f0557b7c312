"""The evaluation notebook's steps (and the CLI's `eval` and `select`): evaluate a model or the
trainer's current policy, mirror the result into OSWorld's layout, run ARPO's task selection, and
find the evaluations and trajectories a run holds, to look at them."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from arpo_lib import build
from arpo_lib.evaluation.evaluate import EvalResult, evaluate_run
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import safe_join

if TYPE_CHECKING:
    from arpo_lib.evaluation.task_selection import SelectionResult
    from arpo_lib.training.trainer import Trainer

log = logging.getLogger(__name__)


def evaluate_policy(trainer: "Trainer", label: str, tasks: list[str] | None = None) -> EvalResult:
    """Evaluate the trainer's current policy with the run's eval protocol; writes <run>/eval/<label>
    (and OSWorld's layout beside it, eval.osworld_results)."""
    result = trainer.evaluate(label, tasks)
    export_results(trainer.cfg, safe_join(trainer.run.eval_root, label))
    log.info("evaluation '%s' (%d episodes, %.1f s)\n%s", label, result.episodes, result.seconds, result.table())
    return result


def run_evaluation(cfg: RunConfig, out_dir: Path) -> EvalResult:
    """Evaluate `cfg.model.path` (or the scripted agent: eval.policy) on the eval tasks (CLI `eval`)."""
    cfg = build.prepare(cfg)  # the task sets expanded: what the evaluation reads beside the engine
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


def run_task_selection(cfg: RunConfig, out_dir: Path | None = None) -> "SelectionResult":
    """ARPO's task selection with the base policy (`cfg.select`): k rollouts per task, keep tasks
    with at least `min_successes` successes. Resumable; writes <run>/selection by default."""
    from arpo_lib.evaluation.task_selection import select_tasks

    out_dir = Path(out_dir) if out_dir is not None else cfg.run.selection
    cfg = build.prepare(cfg)  # the task sets expanded: the candidates are read beside the engine
    with build.engine(cfg) as engine:
        s = cfg.select
        result = select_tasks(engine, s.tasks or cfg.env.tasks, out_dir, k=s.k, min_successes=s.min_successes,
                              seed=s.seed, temperature=s.temperature, max_env_retries=s.max_env_retries,
                              save_trajectories=s.save_trajectories, max_successes=s.max_successes,
                              progress=cfg.logging.progress)
    log.info("task selection: kept %d of %d tasks (%.0f s); written to %s", len(result.kept), len(result.tasks),
             result.seconds, out_dir)
    if result.incomplete:
        log.warning("%d task(s) have fewer than k valid episodes (infrastructure failures): %s",
                    len(result.incomplete), result.incomplete[:5])
    return result


def eval_dirs(run_dir: str | Path) -> list[Path]:
    """Evaluation directories of a run (each holds results.json), oldest first."""
    found = [p.parent for p in RunDir(Path(run_dir)).eval_root.glob(f"*/{layout.EVAL_RESULTS}")]
    return sorted(found, key=lambda p: (p / layout.EVAL_RESULTS).stat().st_mtime)


def plot_run_evals(run_dir: str | Path):
    """A run's last evaluation beside its first (viz.plots.plot_eval); where the run evaluated
    nothing (train.eval_every 0, as the one-GPU and OSWorld configs have), a line saying so and None."""
    from arpo_lib.viz import plots

    found = eval_dirs(run_dir)
    if not found:
        print("no evaluation in this run: train.eval_every is 0 (set it, e.g. overrides=['train.eval_every=4'], "
              "to evaluate every N steps and at the last)")
        return None
    first, last = found[0], found[-1]
    return plots.plot_eval(last, baseline=first if first != last else None, labels=(last.name, first.name))


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

