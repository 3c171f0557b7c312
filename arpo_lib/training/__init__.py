"""Training: rollouts, the ARPO loop, checkpoints, the optimizer and the supervised warm start."""
