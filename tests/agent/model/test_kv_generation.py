"""KV-cached rollout generation (arpo_lib/fast/kv_generation.py) against the naive re-prefill
path, on the real tiny models: same tokens, same behaviour log-probs, far fewer prefilled tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_lib.agent.model.kv_generation import SlabLayer
from arpo_lib.types import SamplingParams
from benchmarks.common import screenshot as _shot


def _episodes(policy, n_envs, n_steps, *, cached, temperature, history_images=15, max_new_tokens=None):
    """Run n_envs conversations side by side; returns their generations per step."""
    convs = [policy.new_conversation(f"Click button {i}") for i in range(n_envs)]
    for c in convs:
        c.history_images = history_images
    out = []
    for step in range(n_steps):
        for i, c in enumerate(convs):
            c.add_observation(_shot(100 * i + step))
        keys = [("ep", i) for i in range(n_envs)] if cached else None
        seeds = [1000 * i + step for i in range(n_envs)]
        gens = policy.generate([c.current for c in convs], seeds=seeds, cache_keys=keys,
                               sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens))
        for c, g in zip(convs, gens):
            c.add_response(g.text, g.token_ids, g.logprobs)
        out.append(gens)
    for i in range(n_envs):
        policy.release(("ep", i))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_reprefill(policy, temperature):
    naive = _episodes(policy, 3, 4, cached=False, temperature=temperature)
    policy.cached.stats.clear()
    cached = _episodes(policy, 3, 4, cached=True, temperature=temperature)
    for step, (a_step, b_step) in enumerate(zip(naive, cached)):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids, f"step {step}"
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    stats = policy.cached.stats
    assert stats["cache_misses"] == 3 and stats["cache_hits"] == 9  # one full prefill per episode
    assert stats["images_encoded"] == 12  # every screenshot through the vision tower once
    assert not policy.cached.entries  # released


def test_prefill_tokens_shrink_with_history(policy):
    """Cached prefill = tokens of the final sequence minus the last response; naive = the sum of
    every step's whole prefix."""
    n_steps = 6
    policy.cached.stats.clear()
    gens = _episodes(policy, 1, n_steps, cached=True, temperature=1.0)
    cached_prefill = policy.cached.stats["prefill_tokens"]
    conv = policy.new_conversation("Click button 0")
    naive_prefill = 0
    for step, (g,) in enumerate(gens):
        conv.add_observation(_shot(step))
        naive_prefill += len(conv.current)
        conv.add_response(g.text, g.token_ids, g.logprobs)
    # cached: every token of the final sequence goes in once, by prefill or as a decoded token
    generated = sum(len(g.token_ids) for (g,) in gens)
    assert len(conv.current) - generated <= cached_prefill <= len(conv.current)
    assert naive_prefill > 3 * cached_prefill  # (6+1)/2 on equal turns; 15 steps give ~8x


def test_history_limit_rerender_is_a_cache_miss(policy):
    """With history_images=2 the conversation starts a new segment at step 3: a changed prefix
    must never reuse the old cache."""
    naive = _episodes(policy, 2, 4, cached=False, temperature=1.0, history_images=2)
    policy.cached.stats.clear()
    cached = _episodes(policy, 2, 4, cached=True, temperature=1.0, history_images=2)
    for a_step, b_step in zip(naive, cached):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids
    assert policy.cached.stats["cache_misses"] > 2


def test_truncated_response_continues_from_cache(policy):
    """Responses cut at max_new_tokens get an <|im_end|> the model never saw: the next step
    must prefill it rather than assume it is cached."""
    naive = _episodes(policy, 2, 3, cached=False, temperature=1.0, max_new_tokens=3)
    cached = _episodes(policy, 2, 3, cached=True, temperature=1.0, max_new_tokens=3)
    assert [[g.token_ids for g in s] for s in naive] == [[g.token_ids for g in s] for s in cached]


def test_duplicate_keys_are_refused(policy):
    conv = policy.new_conversation("x")
    conv.add_observation(_shot(0))
    with pytest.raises(ValueError, match="distinct"):
        policy.generate([conv.current, conv.current], cache_keys=["a", "a"])


def test_slab_layer_appends_in_place_and_grows():
    layer = SlabLayer(4)
    k = torch.randn(2, 3, 3, 8)
    keys, _ = layer.update(k, k.clone())
    assert layer.get_seq_length() == 3 and torch.equal(keys, k)
    more = torch.randn(2, 3, 5, 8)
    keys, values = layer.update(more, more)
    assert layer.get_seq_length() == 8 and torch.equal(keys, torch.cat([k, more], dim=2))
