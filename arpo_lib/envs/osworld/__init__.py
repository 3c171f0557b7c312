"""OSWorld: desktop tasks in desktop_env VMs.

- `env`: `OSWorldEnv`, the adapter around `desktop_env.DesktopEnv` (`make_env("osworld/<id>")`)
- `tasks`: the ARPO fork's task data (fetched once, validated, cached) and the task sets
- `task_cache`, `task_sets`: where the fetched task data lives (fetched with `arpo_lib.run.fetch`), the named sets
- `fake`: `FakeDesktopEnv`, desktop-env's signatures without Docker, for tests and dry runs

Evaluations written in OSWorld's own result layout: `arpo_lib.evaluation.osworld_export` (it reads
our trajectories through the rollout store, a layer above this package).

Standard library (and PIL) only at import: environment workers run in OSWorld's own interpreter.

This file registers the family; desktop_env loads only when an environment is built.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arpo_lib.envs import register_family
from arpo_lib.envs.base import EnvFamily, GUIEnv, Plan, solution_plan


def _make_osworld(task: str, **options: Any) -> GUIEnv:
    """`task_config=<dict>` gives the task itself (its id must be `task`), else the id is loaded."""
    from arpo_lib.envs.osworld.env import OSWorldEnv  # desktop_env loads only when an env is built

    task_config = options.pop("task_config", None)
    if task_config is not None and task_config.get("id") != task:
        raise ValueError(f"task_config is task {task_config.get('id')!r}, not {task!r}")
    return OSWorldEnv(task if task_config is None else task_config, **options)


def _osworld_tasks() -> Sequence[str]:
    """Task ids of the fetched OSWorld task data plus the fake tasks; empty (any id accepted,
    the loader says what is missing) while no data has been fetched."""
    try:
        from arpo_lib.envs.osworld.tasks import cached_task_ids  # stdlib only; [] when not fetched
    except ImportError:
        return []
    ids = list(cached_task_ids())
    from arpo_lib.envs.osworld.fake import FAKE_TASKS  # stdlib + PIL only

    return ids + [t for t in FAKE_TASKS if t not in ids] if ids else []


def _osworld_domain(task: str) -> str:
    from arpo_lib.envs.osworld.tasks import cached_domain

    return cached_domain(task)


def _osworld_task_sets() -> Sequence[str]:
    from arpo_lib.envs.osworld.tasks import TASK_SETS

    return list(TASK_SETS)


def _osworld_task_set(name: str) -> list[str]:
    from arpo_lib.envs.osworld.tasks import task_set

    return task_set(name)


def _osworld_demonstrates(task: str) -> bool:
    from arpo_lib.envs.osworld.sandbox_check import osworld_solution_texts

    return osworld_solution_texts(task) is not None


def _osworld_demonstrate(task: str, instruction: str, info: dict[str, Any], step: int,
                         screen_size: tuple[int, int]) -> Plan:
    from arpo_lib.envs.osworld.sandbox_check import osworld_solution_texts

    return solution_plan(osworld_solution_texts(task), f"osworld/{task}", step, screen_size)


def _osworld_python() -> str:
    from arpo_lib.envs.osworld.env import find_osworld_python

    python = find_osworld_python()
    if python is None:
        raise RuntimeError("env.python=auto: no interpreter with desktop_env found "
                           "(run scripts/setup_osworld.sh or set $ARPO_OSWORLD_PYTHON)")
    return python


register_family(EnvFamily(
    "osworld", _make_osworld,
    "OSWorld desktop tasks in desktop_env VMs (options: provider, screen_size, max_steps, path_to_vm, "
    "cache_root, pause_s, boot_retries, backoff_s, allow_no_kvm, desktop_env_class, task_loader, "
    "task_config, desktop, on_setup_failure, network, sudo, prestart)",
    tasks=_osworld_tasks,
    cache_tasks=False,  # `osworld-tasks fetch` may run while a notebook kernel lives
    domain=_osworld_domain, task_sets=_osworld_task_sets, expand_task_set=_osworld_task_set,
    demonstrates=_osworld_demonstrates, demonstrate=_osworld_demonstrate, python=_osworld_python,
))
