"""Trajectory reward: the environment's task score plus a format term.

ARPO rewards a whole trajectory once, at its end: the checker's task score (0..1) plus
0.5 x a format reward that is -1 when the model's output could not be parsed (the parse failure
also ends the episode) and 0 otherwise. The original computes `eval_results + 0.5 * format_rewards`
in its trainer; here it is one pure function so the trainer, the tests and the notebooks agree.
"""
from __future__ import annotations

import math


def trajectory_reward(
    task_score: float,
    format_ok: bool,
    format_coef: float = 0.5,
    format_penalty: float = -1.0,
) -> float:
    """Scalar reward of one trajectory.

    Args:
        task_score: the environment checker's score, usually in [0, 1].
        format_ok: False when the model's output could not be parsed into an action.
        format_coef: weight of the format term (0.5 in ARPO).
        format_penalty: format reward of an unparseable output (-1 in ARPO); 0 when parseable.

    Returns:
        task_score + format_coef * (format_penalty if not format_ok else 0).
    """
    if not math.isfinite(task_score):
        # A NaN reward would silently poison the whole group's advantages.
        raise ValueError(f"task_score must be finite, got {task_score!r}")
    format_reward = 0.0 if format_ok else format_penalty
    return float(task_score) + format_coef * format_reward
