"""The steps the notebooks and the CLI share, one module per kind of step, so that notebooks stay
lab protocols (no definitions) and the CLI and the tests go through the same code:

- `prepare`: a notebook's first cell: its parameters checked, the repository root, the run's config;
- `train`: open a run's trainer (resuming, or under torchrun), a line per step, the final report;
- `evaluate`: evaluate a model or the trainer's policy, OSWorld's layout, task selection, and
  finding a run's evaluations and trajectories;
- `summary`: the smoke run's summary and the seed-determined digests nbval compares;
- `memory`: the smoke run's peak-memory meter;
- `server`: the inference-server notebook (how to reach it, a real request, stop or keep it);
- `notebooks`: running a notebook headlessly with papermill.

Notebooks call them through the package (`workflows.prepare_run(...)`), which holds every name.
"""
from arpo_lib.workflows.evaluate import (eval_dirs, evaluate_policy, export_results, find_eval, first_trajectory,
                                         plot_run_evals, run_evaluation, run_task_selection)
from arpo_lib.workflows.memory import MemoryMonitor
from arpo_lib.workflows.notebooks import execute_notebook
from arpo_lib.workflows.prepare import NOTEBOOK_PARAMETERS, REPO_ROOT, check_parameters, prepare_run, use_repo_root
from arpo_lib.workflows.server import finish_server, server_instructions, server_smoke_request
from arpo_lib.workflows.summary import (deterministic_digest, format_summary, run_digest, smoke_seeds_table,
                                        smoke_summary)
from arpo_lib.workflows.train import live_progress, open_trainer, print_step, training_report

__all__ = ["MemoryMonitor", "NOTEBOOK_PARAMETERS", "REPO_ROOT", "check_parameters", "deterministic_digest",
           "eval_dirs", "evaluate_policy", "execute_notebook", "export_results", "find_eval", "finish_server",
           "first_trajectory", "format_summary", "live_progress", "open_trainer", "plot_run_evals", "prepare_run", "print_step", "run_digest",
           "run_evaluation", "run_task_selection", "server_instructions", "server_smoke_request", "smoke_seeds_table", "smoke_summary",
           "training_report", "use_repo_root"]
