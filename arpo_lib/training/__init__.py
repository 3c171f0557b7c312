"""Training: the ARPO loop, checkpoints, the optimizer and the supervised warm start (rollouts: `arpo_lib.rollout`)."""
