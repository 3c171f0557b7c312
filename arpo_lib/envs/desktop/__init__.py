"""Real desktop tasks without Docker or a VM: the `desktop/<task>` environment (env.py) on the
desktop sandbox (the `desktop_sandbox` package beside arpo_lib: a sandboxed X desktop running
Debian applications), an OSWorld-format task suite with checkers (tasks.py, tasks/*.json).
Scripted solutions: scripted.py.

This file registers the family; the sandbox starts at an environment's first reset.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arpo_lib.envs import register_family
from arpo_lib.envs.base import EnvFamily, GUIEnv, Plan, solution_plan


def _make_desktop(task: str, **options: Any) -> GUIEnv:
    from arpo_lib.envs.desktop.env import DesktopEnv  # the sandbox starts at the first reset

    return DesktopEnv(task, **options)


def _desktop_tasks() -> Sequence[str]:
    from arpo_lib.envs.desktop.tasks import desktop_tasks  # reads the suite's JSON files

    return desktop_tasks()


def _desktop_demonstrate(task: str, instruction: str, info: dict[str, Any], step: int,
                         screen_size: tuple[int, int]) -> Plan:
    from arpo_lib.envs.desktop.scripted import solution_texts  # every task file holds its solution

    return solution_plan(solution_texts(task), f"desktop/{task}", step, screen_size)


register_family(EnvFamily(
    "desktop", _make_desktop,
    "Real desktop applications (text editor, terminal, file manager, Chromium) in a sandboxed X "
    "desktop, checked like OSWorld (options: screen, max_steps, settle_s, wait_s, reward, limits, isolation, "
    "desktop, network, sudo)",
    tasks=_desktop_tasks,
    demonstrates=lambda task: task in _desktop_tasks(), demonstrate=_desktop_demonstrate,
))
