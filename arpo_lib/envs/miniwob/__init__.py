"""MiniWoB++ (`miniwob/<task>`, `miniwob/<task>@<seed>`): web tasks in headless Chromium.

- `env`: `MiniWoBEnv` (the miniwob package's gymnasium environment, screenshots, our actions)
- `browser`: finding Chromium (or Google Chrome) and its matching chromedriver
- `scripted`: DOM-reading demonstrations for the tasks it knows

This file registers the family; selenium and miniwob load only when an environment is built.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arpo_lib.envs import register_family
from arpo_lib.envs.base import EnvFamily, GUIEnv, Plan


def _make_miniwob(task: str, **options: Any) -> GUIEnv:
    from arpo_lib.envs.miniwob.env import MiniWoBEnv  # selenium/miniwob load only when built

    return MiniWoBEnv(task, **options)


def _miniwob_tasks() -> Sequence[str]:
    from arpo_lib.envs.miniwob.env import miniwob_tasks  # reads the package's files, no import

    return miniwob_tasks()


def _miniwob_demonstrates(task: str) -> bool:
    from arpo_lib.envs.miniwob import scripted as miniwob_scripted

    return miniwob_scripted.supports(task)


def _miniwob_demonstrate(task: str, instruction: str, info: dict[str, Any], step: int,
                         screen_size: tuple[int, int]) -> Plan:
    from arpo_lib.envs.miniwob import scripted as miniwob_scripted

    return miniwob_scripted.plan(task, instruction, info, step, screen_size)


register_family(EnvFamily(
    "miniwob", _make_miniwob,
    "MiniWoB++ web tasks in headless Chromium (options: scale, reward, max_steps, "
    "wait_seconds, episode_max_time_s, headless)",
    tasks=_miniwob_tasks, seeded_layouts=True, alias=lambda task: task.removesuffix("-v1"),
    demonstrates=_miniwob_demonstrates, demonstrate=_miniwob_demonstrate,
))
