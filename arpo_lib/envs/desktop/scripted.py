"""Scripted solutions of the desktop suite: each task's `x_solution`, UI-TARS action texts parsed
by the same parser as the model's answers, so a solution is also a demonstration to learn from."""
from __future__ import annotations

from arpo_lib.actions import Action, parse_response
from arpo_lib.envs.desktop.tasks import load_task


def solution_texts(task_id: str) -> list[str]:
    """The task's scripted solution, one UI-TARS action text per step."""
    return list(load_task(task_id)["x_solution"])


def solution_actions(task_id: str, image_size: tuple[int, int], coord_mode: str = "qwen25vl") -> list[Action]:
    """The scripted solution as actions (points, if any, in screenshot pixels of `image_size`),
    ending with finished()."""
    actions = []
    for text in [*solution_texts(task_id), "finished(content='')"]:
        actions += parse_response(f"Thought: scripted\nAction: {text}", image_size, coord_mode).actions
    return actions
