"""Training: the ARPO loop, checkpoints, the optimizer, and what makes models: the supervised warm
start (`sft`) and the tiny random checkpoints of the real architectures (`tiny_model`). Rollouts:
`arpo_lib.rollout`."""
