"""Speed and memory levers for one GPU (issue 5), each with its naive counterpart kept for the
benchmarks in benchmarks/ and the equivalence tests in tests/test_fast_*.py:

- kv_generation: rollouts keep each episode's KV cache between steps (vs re-prefilling the history)
- logprobs: token log-probs from hidden states in chunks, logits recomputed in backward
- vision_attention: the vision tower's per-window attention in a few batched SDPA calls
- batching: micro-batches sized by a token budget
- memory: LoRA (peft) and low-memory optimizers as config switches
"""
