"""KV-cached rollout generation (arpo_lib/fast/kv_generation.py) against the naive re-prefill
path, on the real tiny models: same tokens, same behaviour log-probs, far fewer prefilled tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_lib.agent.model.kv_generation import EOS_CHECK_EVERY, BatchSlab, RowLayer, SlabLayer, decode_mask
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


def _padded_batch(policy, n_envs=3):
    convs = [policy.new_conversation("Click" + " the button" * i) for i in range(n_envs)]  # unequal lengths
    for i, c in enumerate(convs):
        c.add_observation(_shot(i))
    return convs


def test_rows_ending_at_different_steps_match_reprefill(policy, monkeypatch):
    """Rows that end early (the end-of-sequence check runs every few tokens, the extra steps are
    cut off): the same tokens and log-probs as the naive path, and each episode's cache holds what
    a loop that stopped at the last row's end would have left (the last sampled token unfed)."""
    probe = _episodes(policy, 3, 1, cached=True, temperature=1.0)[0]
    ends = [3, 9, 5]  # made end-of-sequence tokens, so the rows stop there or earlier
    monkeypatch.setattr(policy, "eos_ids", list(policy.eos_ids) + [g.token_ids[e] for g, e in zip(probe, ends)])
    naive = _episodes(policy, 3, 3, cached=False, temperature=1.0)
    cached = _episodes(policy, 3, 3, cached=True, temperature=1.0)
    for a_step, b_step in zip(naive, cached):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    lengths = [len(g.token_ids) for g in cached[0]]
    assert max(lengths) <= 10 and len(set(lengths)) > 1  # ended early, at different steps

    convs = _padded_batch(policy)
    keys = [("end", i) for i in range(3)]
    gens = policy.generate([c.current for c in convs], seeds=[0, 1000, 2000], cache_keys=keys,
                           sampling=SamplingParams(temperature=1.0))
    last = max(len(g.token_ids) for g in gens)
    for c, g, key in zip(convs, gens, keys):
        kept = min(last - 1, len(g.token_ids))
        assert policy.cached.entries[key].ids == list(c.current.input_ids) + g.token_ids[:kept]
        policy.release(key)


def _host_reads(policy, monkeypatch, max_new_tokens):
    """Tensor-to-host reads (each one a device sync off the CPU) during one cached generate."""
    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, **k: reads.append(1) or _real(self, *a, **k))
    convs = _padded_batch(policy)
    keys = [("reads", i) for i in range(len(convs))]
    gens = policy.generate([c.current for c in convs], seeds=[1, 2, 3], cache_keys=keys,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    monkeypatch.undo()
    for key in keys:
        policy.release(key)
    assert all(len(g.token_ids) == max_new_tokens for g in gens)  # no row ended: every step decoded
    return len(reads)


def test_decoding_reads_the_device_every_few_tokens_not_every_token(policy, monkeypatch):
    """Neither the end-of-sequence check nor the attention mask reads the device per token
    (the old loop read `finished.all()`, and transformers the padding mask, at every token)."""
    extra = _host_reads(policy, monkeypatch, 24) - _host_reads(policy, monkeypatch, 8)
    assert extra <= 16 // EOS_CHECK_EVERY


@pytest.mark.parametrize("padded", [False, True])
def test_decode_mask_is_the_one_transformers_builds(policy, padded):
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask

    config = policy.model.config.get_text_config()
    attention = torch.ones(3, 7, dtype=torch.long)
    if padded:
        attention[0, :2] = attention[2, :4] = 0
    cache = DynamicCache(config=config)
    head_dim = config.hidden_size // config.num_attention_heads
    past = torch.zeros(3, config.num_key_value_heads, 6, head_dim)
    cache.update(past, past, 0)
    theirs = create_causal_mask(config=config, inputs_embeds=torch.zeros(3, 1, config.hidden_size),
                                attention_mask=attention, past_key_values=cache,
                                position_ids=torch.full((1, 1), 6))
    ours = decode_mask(policy.model, attention, padded)
    if isinstance(ours, dict):
        ours = ours["full_attention"]
    assert (ours is None and theirs is None) or torch.equal(ours, theirs)


@pytest.mark.parametrize("n_envs", [1, 3])
def test_one_kv_slab_per_step_sized_by_the_response_cap(policy, monkeypatch, n_envs):
    """A step allocates one cache per layer, (B, H_kv, W + max_new_tokens, D) for B episodes of at
    most W tokens (one episode: its length + the cap), and every row's prefill writes into it in
    place: no per-row cache beside it. (The old path prefilled into per-row caches, then merged
    them into a batch cache: n_envs + 1 allocations per layer.) Episodes keep compact copies."""
    slabs, allocations = [], []
    real_allocate, real_slab_allocate = SlabLayer._allocate, BatchSlab.allocate

    def allocate(self, like):
        allocations.append(self)
        return real_allocate(self, like)

    def slab_allocate(self, like):
        new = self.key_buf is None
        real_slab_allocate(self, like)
        if new:
            slabs.append(self.value_buf.shape)

    monkeypatch.setattr(SlabLayer, "_allocate", allocate)
    monkeypatch.setattr(BatchSlab, "allocate", slab_allocate)
    cap = 5
    convs = _padded_batch(policy, n_envs)
    keys = [("slab", i) for i in range(n_envs)]
    gens = policy.generate([c.current for c in convs], seeds=list(range(n_envs)), cache_keys=keys,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=cap))
    monkeypatch.undo()
    width = max(len(c.current.input_ids) for c in convs)
    config = policy.model.config.get_text_config()
    n_layers = config.num_hidden_layers
    assert len(slabs) == n_layers
    assert {shape[:3] for shape in slabs} == {(n_envs, config.num_key_value_heads, width + cap)}
    assert all(isinstance(layer, RowLayer) for layer in allocations)  # only views of the slab
    last = max(len(g.token_ids) for g in gens)
    for c, g, key in zip(convs, gens, keys):  # compact: the slab's unused slots are not kept
        kept = len(c.current.input_ids) + min(last - 1, len(g.token_ids))
        k = policy.cached.entries[key].kv[0][0]
        assert k.shape[2] == kept and k.untyped_storage().nbytes() == k.numel() * k.element_size()
        policy.release(key)


@pytest.mark.parametrize("budget", [10**6, 700])
def test_batched_prefill_draws_what_the_naive_path_draws(policy, monkeypatch, budget):
    """The rows' new turns prefilled together (left-padded, each row's cached keys before
    its new ones, one vision-tower call for the batch's screenshots) rather than one forward per
    episode: the same tokens and log-probs as re-prefilling every history, with 3 episodes of 4
    steps (a budget of 700 tokens splits the first step's long prompts, not the later turns)."""
    naive = _episodes(policy, 3, 4, cached=False, temperature=1.0)
    monkeypatch.setattr(policy.cached, "prefill_batch_tokens", budget)
    policy.cached.stats.clear()
    batched = _episodes(policy, 3, 4, cached=True, temperature=1.0)
    for step, (a_step, b_step) in enumerate(zip(naive, batched)):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids, f"step {step}"
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    stats = policy.cached.stats
    assert stats["cache_misses"] == 3 and stats["cache_hits"] == 9 and stats["images_encoded"] == 12
    assert 3 <= stats["batched_prefills"] <= 4  # one forward for the rows of each later step (and the first)


@pytest.mark.parametrize("variant", ["qwen2vl", "qwen25vl"])
def test_the_batched_prefill_attends_each_key_head_without_copying_it(variant, tmp_path, monkeypatch):
    """Under the batched prefill's mask, transformers' SDPA path copies the whole cache to every
    query head (`repeat_kv`); the prefill attends each key/value head with a broadcast view
    instead: no key or value handed to SDPA is an expanded copy, the tokens and log-probs stay
    those of the naive path, and the configured attention is back once the prefill is done. Two
    key/value heads of two query heads each (with one key/value head, `repeat_kv` is a view)."""
    import torch.nn.functional as F

    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.training.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "grouped", variant, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256)
    torch.manual_seed(0)
    grouped = HFPolicy(path, device="cpu", max_new_tokens=24, history_images=15)
    config = grouped.model.config.get_text_config()
    real, seen = F.scaled_dot_product_attention, []

    def spy(query, key, value, *args, **kwargs):
        if kwargs.get("attn_mask") is not None and query.shape[2] > 1:
            seen.append((key.shape[1], key.stride(1), value.stride(1)))
        return real(query, key, value, *args, **kwargs)

    naive = _episodes(grouped, 3, 3, cached=False, temperature=1.0)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(grouped.cached, "prefill_batch_tokens", 10**6)
    batched = _episodes(grouped, 3, 3, cached=True, temperature=1.0)
    assert seen and grouped.cached.stats["batched_prefills"] >= 3
    assert all(k_stride == 0 and v_stride == 0 for heads, k_stride, v_stride in seen if heads > 1), seen
    for a_step, b_step in zip(naive, batched):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    assert config._attn_implementation == "sdpa"


def test_prefill_rows_are_grouped_within_the_token_budget(policy, monkeypatch):
    from arpo_lib.agent.model import kv_generation

    monkeypatch.setattr(policy.cached, "prefill_batch_tokens", 100)
    assert policy.cached._batches([30, 40, 20, 120, 10], 500) == [[0, 1], [2], [3], [4]]
    # the mask counts too: 2 rows x 40 x 5000 keys = 400k entries over a limit of 300k
    monkeypatch.setattr(kv_generation, "PREFILL_MASK_ELEMENTS", 300_000)
    assert policy.cached._batches([30, 40, 20], 5000) == [[0], [1], [2]]
    assert policy.cached._batches([30, 40, 20], 3000) == [[0, 1], [2]]
    monkeypatch.setattr(policy.cached, "prefill_batch_tokens", "auto")  # the CPU: one forward per row
    assert policy.cached._batches([3, 4], 10) == [[0], [1]]
    monkeypatch.setattr(policy.cached, "prefill_batch_tokens", 0)
    assert policy.cached._batches([3, 4], 10) == [[0], [1]]


def test_the_batched_prefill_mask_sees_each_rows_own_tokens():
    from arpo_lib.agent.model.kv_generation import prefill_mask

    # width 6; row 0: 5 tokens, 2 new (at slab 4, 5); row 1: 3 tokens, all new (3..5); T = 3
    mask = prefill_mask([5, 3], [2, 3], 6, torch.device("cpu"))[:, 0].int().tolist()
    assert mask[0] == [[0, 0, 0, 0, 0, 1],   # padding query: the row's last token only
                       [0, 1, 1, 1, 1, 0],   # slab 4: its cached 1..3 and itself
                       [0, 1, 1, 1, 1, 1]]
    assert mask[1] == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_the_prefill_budget_is_a_config_key(tiny_qwen2vl):
    from arpo_lib import build
    from arpo_lib.run.config import ConfigError, load_config

    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", "model.prefill_batch_tokens=4096"])
    assert build.hf_policy(cfg).cached.prefill_batch_tokens == 4096
    assert build.hf_policy(load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}"])).cached.prefill_batch_tokens \
        == "auto"
    with pytest.raises(ConfigError, match=r"model\.prefill_batch_tokens: must be >= 0"):
        load_config("configs/smoke.yaml", ["model.prefill_batch_tokens=-1"])


def test_an_episodes_old_cache_is_released_once_its_row_is_in_the_slab(policy):
    """One KV copy per live episode plus the step's slab: at a cache-hit step each episode's old
    copy is dropped as soon as its keys and values are written into the slab, so none is alive
    while the batch decodes (before, every old copy lived until the step ended, beside the slab
    and the new copies: three copies at the peak)."""
    import gc
    import weakref

    n = 3
    convs = _padded_batch(policy, n)
    keys = [("release", i) for i in range(n)]
    gens = policy.generate([c.current for c in convs], seeds=list(range(n)), cache_keys=keys,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=4))
    for c, g in zip(convs, gens):
        c.add_response(g.text, g.token_ids, g.logprobs)
        c.add_observation(_shot(7))
    old = [weakref.ref(t) for key in keys for pair in policy.cached.entries[key].kv for t in pair]
    seen = []

    def probe(module, args, kwargs):
        gc.collect()
        ids = kwargs.get("input_ids")
        seen.append((tuple(ids.shape), sum(ref() is not None for ref in old)))

    hook = policy.model.model.register_forward_pre_hook(probe, with_kwargs=True)
    try:
        policy.generate([c.current for c in convs], seeds=list(range(n)), cache_keys=keys,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=4))
    finally:
        hook.remove()
        for key in keys:
            policy.release(key)
    prefills = [alive for shape, alive in seen if shape[1] > 1]
    decodes = [alive for shape, alive in seen if shape == (n, 1)]
    assert prefills and decodes
    per_episode = len(old) // n
    assert prefills[0] <= (n - 1) * per_episode  # the row being prefilled has let its old copy go
    assert set(decodes) == {0}, seen  # nothing of the old copies while the batch decodes


def test_keys_and_values_are_kept_in_the_compute_dtype(tiny_model):
    """Under bf16 autocast the cache is stored in bf16: the same tokens and log-probs as fp32
    storage (SDPA casts the keys and values to bf16 before attending anyway), half the bytes."""
    from arpo_lib.agent.hf_policy import HFPolicy

    bf16 = HFPolicy(tiny_model, device="cpu", compute_dtype="bfloat16")
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        bf16.cached.kv_dtype = dtype
        gens = _episodes(bf16, 2, 3, cached=True, temperature=1.0)
        convs = _padded_batch(bf16, 2)
        bf16.generate([c.current for c in convs], seeds=[0, 1], cache_keys=["a", "b"],
                      sampling=SamplingParams(temperature=1.0, max_new_tokens=4))
        k = bf16.cached.entries["a"].kv[0][0]
        runs[dtype] = ([[g.token_ids for g in step] for step in gens], [[g.logprobs for g in step] for step in gens],
                       k.dtype, k.numel() * k.element_size())
        bf16.cached.clear()
    (t32, lp32, d32, b32), (t16, lp16, d16, b16) = runs[torch.float32], runs[torch.bfloat16]
    assert (d32, d16) == (torch.float32, torch.bfloat16) and b16 * 2 == b32
    assert t16 == t32
    np.testing.assert_array_equal(np.array(lp16, dtype=object), np.array(lp32, dtype=object))
    assert HFPolicy(tiny_model, device="cpu").cached.kv_dtype == torch.float32  # fp32 compute: fp32 cache


def test_decoding_makes_no_tensor_from_host_data_per_token(policy):
    """The suppressed ids go to the device once per call, not at every decoded token (indexing with
    a Python list makes a tensor from host data each time: on a GPU a blocking host-to-device copy).
    A dispatch-mode spy counts the tensors made from host data over calls of 4 and of 16 tokens:
    the same count, whatever the length."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    assert policy.suppress_ids
    made = []
    for tokens in (4, 16):
        convs = _padded_batch(policy, 2)
        spy = Spy()
        with spy:
            gens = policy.generate([c.current for c in convs], seeds=[0, 1], cache_keys=[("h2d", tokens, i) for i in range(2)],
                                   sampling=SamplingParams(temperature=1.0, max_new_tokens=tokens))
        for i in range(2):
            policy.release(("h2d", tokens, i))
        assert max(len(g.token_ids) for g in gens) > 4 or tokens == 4
        made.append(spy.seen["aten.lift_fresh.default"])
    assert made[0] == made[1], made
