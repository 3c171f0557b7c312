"""The policy model's internals: one file per speed or memory lever, each with its naive
counterpart kept for the benchmarks in benchmarks/ and the equivalence tests.

- kv_generation: rollouts keep each episode's KV cache between steps (vs re-prefilling the history)
- logprobs: token log-probs from hidden states in chunks, logits recomputed in backward
- vision_attention: the vision tower's per-window attention in a few batched SDPA calls
- packing: several trajectories in one row with per-sequence M-RoPE positions
- lora: LoRA adapters (peft) and their merged weights
- shards: whole tensors from FSDP2 shards, one at a time (a push's and a save's loop)

Precision: weights and optimizer state stay fp32 (master weights); forward passes run under
`autocast` in the compute dtype (bf16 on a GPU).
"""
from __future__ import annotations

import torch


def autocast(device: torch.device, dtype: torch.dtype, keep_casts: bool = True):
    """The forward-pass precision context: `dtype` under autocast, a no-op for float32.

    `keep_casts`: autocast's cast cache, which holds the `dtype` copy of every fp32 weight that
    requires grad until the context exits, so that a backward finds the copy its forward used.
    Without it each weight is cast where an operation uses it and freed after."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=keep_casts)
