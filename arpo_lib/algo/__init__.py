"""The algorithm, as pure functions: rewards, group advantages, the clipped loss, and ARPO's replay.

    reward    = trajectory_reward(task_score, format_ok)           # one number per trajectory
    advantage = group_advantages(rewards_of_one_group)             # (G,) -> (G,)
    loss, m   = policy_loss(logprobs, old_logprobs, adv, mask)     # (B, T) tokens -> scalar
    ReplayBuffer: per-task successes injected into all-failed groups (arpo_lib/algo/replay.py)
    groups    = make_groups(tasks, trajectories, buffer, load=..., advantages=...)   # a batch -> groups

The trainer reaches the advantage and the loss through their registries (`ADV_ESTIMATORS`,
`POLICY_LOSSES`: `algo.adv_estimator`, `algo.policy_loss`), where a plug-in adds its own.
"""
from arpo_lib.algo.advantages import group_advantages, is_all_failed
from arpo_lib.algo.loss import AGGREGATIONS, policy_loss, truncated_is_weights
from arpo_lib.algo.grouping import make_groups
from arpo_lib.algo.replay import Injection, ReplayBuffer, item_directory, replay_item
from arpo_lib.algo.rewards import trajectory_reward
from arpo_lib.run.registry import ADV_ESTIMATORS, POLICY_LOSSES

__all__ = [
    "ADV_ESTIMATORS",
    "AGGREGATIONS",
    "Injection",
    "POLICY_LOSSES",
    "ReplayBuffer",
    "group_advantages",
    "is_all_failed",
    "item_directory",
    "make_groups",
    "policy_loss",
    "replay_item",
    "trajectory_reward",
    "truncated_is_weights",
]
