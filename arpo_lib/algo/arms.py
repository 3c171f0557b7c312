"""The arms a comparison sets against each other (`compare.algos`, arpo_lib/experiments.py): each
is a registered set of dotted config overrides applied to every run of that arm.

They live beside the algorithm rather than with the study because they are algorithm variants
(replay on or off, how replayed tokens are weighed), and because config validation reads this
registry: it must not import the whole study to check an arm's name. A plug-in adds an arm with
one line, e.g. `COMPARISON_ARMS.register("dr_grpo", {"algo.replay.enabled": False,
"algo.norm_adv_by_std": False})`.
"""
from __future__ import annotations

from arpo_lib.run.registry import COMPARISON_ARMS

# plain GRPO: no replay buffer
COMPARISON_ARMS.register("grpo", {"algo.replay.enabled": False, "algo.replay.correction": "none"})
# ARPO as published: replayed successes treated as on-policy
COMPARISON_ARMS.register("arpo", {"algo.replay.enabled": True, "algo.replay.correction": "none"})
# ARPO with replayed trajectories weighted by truncated importance ratios
COMPARISON_ARMS.register("arpo_tis", {"algo.replay.enabled": True, "algo.replay.correction": "tis"})
# ARPO with the buffer seeded before the first step with the successes task selection found (the
# experiment points `algo.replay.seed_from` at its selection's trajectories): ARPO's buffer starts
# empty, so a task the policy never solves itself during training never gets a replay
COMPARISON_ARMS.register("arpo_seeded", {"algo.replay.enabled": True, "algo.replay.correction": "none",
                                         "algo.replay.seed_from": "selection"})
# ARPO with generation served (vLLM, weights streamed after every update), the next batch waiting for
# the update (staleness 0), against the same with one batch playing ahead on the weights of one batch
# before (`rollout.max_staleness=1`, asynchronous episodes, stale tokens weighted by truncated
# importance ratios): does asynchronous ARPO cost learning? (docs/asynchronous.md)
_SERVED = {"algo.replay.enabled": True, "algo.replay.correction": "none", "rollout.backend": "server",
           "rollout.weight_sync": "stream", "serve.backend": "vllm", "serve.weight_sync": True}
COMPARISON_ARMS.register("arpo_served", {**_SERVED, "rollout.mode": "lockstep", "rollout.max_staleness": 0})
_AHEAD = {**_SERVED, "rollout.mode": "async", "rollout.max_staleness": 1}
COMPARISON_ARMS.register("arpo_async1", {**_AHEAD, "algo.stale_correction": "tis"})
# the same without the correction: the stale tokens treated as on-policy (the ratio against the
# weights at the update's start only), to tell what the correction does for the staleness's cost
COMPARISON_ARMS.register("arpo_async1_plain", {**_AHEAD, "algo.stale_correction": "none"})
