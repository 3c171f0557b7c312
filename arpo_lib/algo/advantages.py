"""Group-relative advantages (GRPO) and ARPO's "all failed" test.

Each task is rolled out G times (G = 8 in ARPO); a trajectory's advantage is its reward
standardised within its group, and every assistant token of the trajectory gets that value
(the loss broadcasts it). No value function, no discounting: the reward is given once per episode.

The trainer calls the estimator that `algo.adv_estimator` names in `ADV_ESTIMATORS` (one signature:
`estimator(rewards, cfg) -> advantages`); `grpo`, the one below, is GRPO's and ARPO's.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from arpo_lib.run.config import AlgoConfig
from arpo_lib.run.registry import ADV_ESTIMATORS


def group_advantages(rewards: torch.Tensor | Sequence[float], eps: float = 1e-6,
                     norm_by_std: bool = True) -> torch.Tensor:
    """Standardise rewards within a group: (r - mean) / (std + eps), or only r - mean.

    The std uses Bessel's correction (as torch.std and verl's GRPO estimator do), so the
    rewards (1, 0, 0, 0, 0, 0, 0, 0) give +2.475 for the success and -0.354 for each failure.

    Args:
        rewards: (G,) rewards of one group, or (N, G) for N groups (standardised along the last dim).
        eps: added to the std so an all-equal group gives zeros instead of 0/0.
        norm_by_std: divide by the std (GRPO, ARPO, verl's default). False: r - mean only
            (verl's `norm_adv_by_std_in_grpo=False`, "Dr. GRPO"): a group that is nearly all
            successes (or all failures) then weighs by its small spread instead of being
            blown up to unit scale -- (1, ..., 1, -0.5) of 16 gives the outlier -1.41, not -3.75.

    Returns:
        (G,) or (N, G) float32 advantages. A group of one (G = 1) has no spread to compare
        against, so its advantage is 0 (torch.std would return NaN there).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.dim() not in (1, 2):
        raise ValueError(f"rewards must be shaped (G,) or (N, G), got {tuple(r.shape)}")
    if r.shape[-1] == 0:
        raise ValueError("rewards must hold at least one reward per group")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    if r.shape[-1] == 1:
        return torch.zeros_like(r)
    mean = r.mean(dim=-1, keepdim=True)
    if not norm_by_std:
        return r - mean
    std = r.std(dim=-1, keepdim=True, unbiased=True)
    return (r - mean) / (std + eps)


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """GRPO's estimator: `group_advantages` with `algo.adv_eps` and `algo.norm_adv_by_std`.
    rewards: (G,) of one group -> (G,) advantages."""
    return group_advantages(rewards, eps=cfg.adv_eps, norm_by_std=cfg.norm_adv_by_std)


def is_all_failed(
    scores: Sequence[float] | np.ndarray | torch.Tensor,
    std_threshold: float = 0.05,
    mean_threshold: float = 0.2,
) -> bool:
    """ARPO's test for a group that gives no learning signal: std < 0.05 and mean < 0.2.

    `scores` are TASK scores of one group (format reward not counted). The std is the
    POPULATION std (ddof=0): the original's `apply_replay` (verl/trainer/ray_trainer.py in
    dvlab-research/ARPO) calls `np.std` on the group's eval results, whose default is ddof=0.
    This differs from the Bessel std of `group_advantages`, on purpose, to match the original.

    Args:
        scores: (G,) task scores of one group, G >= 1.
        std_threshold: the group is flat when its population std is strictly below this.
        mean_threshold: ... and failed when its mean is strictly below this.
    """
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().cpu().double().numpy()
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores must be a non-empty 1-D sequence, got shape {s.shape}")
    return bool(s.std(ddof=0) < std_threshold and s.mean() < mean_threshold)
