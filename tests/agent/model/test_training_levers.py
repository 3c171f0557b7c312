"""The training-side levers of arpo_lib/fast against their naive counterparts on the real tiny
models: batched vision attention vs transformers' per-window loop, chunked log-probs vs all at
once (values and gradients), token-budget micro-batches, LoRA and Adafactor."""
from __future__ import annotations

import pytest
import torch

from arpo_lib.training.optim import padding_fraction, token_budget_batches
from arpo_lib.agent.model.logprobs import token_logprobs
from arpo_lib.training.optim import make_optimizer, optimizer_state_bytes
from arpo_lib.agent.model.vision_attention import use_batched_vision_attention, use_looped_vision_attention
from benchmarks.common import screenshot as _shot
from arpo_lib.agent.hf_policy import HFPolicy, enable_activation_checkpointing
from arpo_lib.types import SamplingParams


def _segments(policy, n=2, steps=3):
    segs = []
    for i in range(n):
        conv = policy.new_conversation(f"Click button {i}")
        for step in range(steps):
            conv.add_observation(_shot(10 * i + step, size=(320 + 56 * i, 420)))  # images of two sizes
            g = policy.generate([conv.current], sampling=SamplingParams(max_new_tokens=12), seeds=[i * 100 + step])[0]
            conv.add_response(g.text, g.token_ids, g.logprobs)
        segs.append(conv.current)
    return segs


def _logprobs_and_grads(policy, segs):
    policy.model.zero_grad(set_to_none=True)
    lps = policy.sequence_logprobs(segs)
    torch.cat(lps).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in lps], grads


def test_optimised_training_path_equals_naive(policy):
    """Batched vision attention + chunked log-probs + gradient checkpointing give the naive
    path's log-probs and gradients (all parameters, the vision tower's included)."""
    segs = _segments(policy)
    use_looped_vision_attention(policy.model)
    policy.logprob_chunk = 0
    naive_lp, naive_grads = _logprobs_and_grads(policy, segs)
    use_batched_vision_attention(policy.model)
    policy.logprob_chunk = 7  # several chunks, the last one partial
    enable_activation_checkpointing(policy.model)
    policy.model.train()
    try:
        fast_lp, fast_grads = _logprobs_and_grads(policy, segs)
    finally:
        policy.model.activation_checkpointing_disable()
        policy.model.eval()
        policy.logprob_chunk = 1024
    for a, b in zip(naive_lp, fast_lp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert naive_grads.keys() == fast_grads.keys()
    assert any("visual" in n for n in naive_grads)
    for name in naive_grads:
        torch.testing.assert_close(naive_grads[name], fast_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_batched_vision_attention_makes_one_call_per_window_size(policy, monkeypatch):
    import arpo_lib.agent.model.vision_attention as va

    import types

    segs = _segments(policy, n=1, steps=1)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(va, "F", types.SimpleNamespace(
        scaled_dot_product_attention=lambda q, *a, **k: calls.append(q.shape) or real(q, *a, **k)))
    with torch.no_grad():
        policy.sequence_logprobs(segs)
    windows_per_call = [shape[0] for shape in calls]
    assert calls and max(windows_per_call) >= 1
    depth = policy.model.config.vision_config.depth
    assert len(calls) <= 4 * depth  # at most a handful of window sizes per layer


def test_chunked_logprobs_gradient_matches_on_random_head():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    tokens = torch.randint(0, 50, (23,))
    full = token_logprobs(hidden, tokens, head, temperature=0.7, suppress_ids=[3, 4], chunk=0)
    (g_full,) = torch.autograd.grad(full.square().sum(), hidden)
    chunked = token_logprobs(hidden, tokens, head, temperature=0.7, suppress_ids=[3, 4], chunk=5)
    (g_chunk,) = torch.autograd.grad(chunked.square().sum(), hidden)
    torch.testing.assert_close(full, chunked)
    torch.testing.assert_close(g_full, g_chunk)


def test_token_budget_batches():
    lengths = [100, 30, 400, 35, 90, 700]
    batches = token_budget_batches(lengths, 300)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 300
    assert [5] in batches and [2] in batches  # longer than the budget: alone
    fixed = [[0, 1], [2, 3], [4, 5]]
    assert padding_fraction(batches, lengths) < padding_fraction(fixed, lengths)
    packed = token_budget_batches(lengths, 300, packed=True)
    for b in packed:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 300
    assert len(packed) <= len(batches)
    with pytest.raises(ValueError):
        token_budget_batches(lengths, 0)


def test_lora_trains_only_adapters_and_saves_merged_weights(tiny_qwen2vl, tmp_path):
    torch.manual_seed(0)
    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=12, lora_rank=4, lora_alpha=8)
    params = policy.trainable_parameters()
    total = sum(p.numel() for p in policy.model.parameters())
    assert params and sum(p.numel() for p in params) < 0.2 * total
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert all("lora_" in n and "language_model" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    segs = _segments(policy, n=1, steps=2)
    optimizer = make_optimizer("adamw", params, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        optimizer.zero_grad()
        (-torch.cat(policy.sequence_logprobs(segs)).mean()).backward()
        optimizer.step()
    for n, p in policy.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    with torch.no_grad():
        trained = torch.cat(policy.sequence_logprobs(segs))
    policy.save(tmp_path / "m")
    assert (tmp_path / "m" / "adapter.pt").is_file()
    merged = HFPolicy(tmp_path / "m", device="cpu")  # a plain model: the adapters folded in
    assert not any("lora" in n for n, _ in merged.model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(merged.sequence_logprobs(segs)), trained, atol=1e-5, rtol=1e-5)
    fresh = HFPolicy(tiny_qwen2vl, device="cpu", lora_rank=4, lora_alpha=8)  # resume: base + adapter
    fresh.load_adapter(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(fresh.sequence_logprobs(segs)), trained, atol=1e-5, rtol=1e-5)


def test_lora_weights_for_a_server_carry_the_base_names_and_are_merged_one_at_a_time(tiny_qwen2vl):
    """What `rollout.weight_sync=stream` sends with LoRA (`TrainingBackend.full_weights`): the plain
    model's names in its order (a server's loader rejects peft's `base_layer`/`lora_A` names) and
    the merged values, each adapted weight merged only when the stream reads it."""
    from arpo_lib.agent.model.lora import MergedWeight, merged_state_dict
    from arpo_lib.training.backend import training_backend
    from arpo_lib.training.distributed import SINGLE

    plain = HFPolicy(tiny_qwen2vl, device="cpu")
    policy = HFPolicy(tiny_qwen2vl, device="cpu", lora_rank=4, lora_alpha=8)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: B is zero at the start
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    sent = training_backend(policy, SINGLE, micro_batch_size=1, token_budget=0, pack=False).full_weights()
    assert [n for n, _ in sent] == [n for n, _ in plain.model.named_parameters()]
    lazy = [n for n, t in sent if isinstance(t, MergedWeight)]
    assert len(lazy) == sum(n.endswith("lora_A.default.weight") for n, _ in policy.model.named_parameters())
    merged = merged_state_dict(policy.model)
    for name, t in sent:
        value = t.full_tensor() if isinstance(t, MergedWeight) else t
        assert value.shape == t.shape and value.dtype == t.dtype and torch.equal(value, merged[name]), name
    q_proj = next(n for n in lazy if n.endswith("layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(dict(sent)[q_proj].full_tensor(), dict(plain.model.named_parameters())[q_proj])


def test_a_lora_checkpoint_merges_one_weight_at_a_time_on_the_device(tiny_qwen2vl, monkeypatch):
    """Regression: the save's merge held an fp32 merged copy of every adapted weight on the model's
    device at once (~26 GB at 7B, at every checkpoint). Each is now moved to host memory before
    the next is made: when a merge starts, no earlier merge's device tensor is alive. The saved
    values are the merge's, exactly."""
    import weakref

    from arpo_lib.agent.model import lora

    policy = HFPolicy(tiny_qwen2vl, device="cpu", lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    real, made, alive_at_start = lora._merged, [], []

    def spy(layer):
        alive_at_start.append(sum(ref() is not None for ref in made))
        out = real(layer)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(lora, "_merged", spy)
    state = lora.merged_state_dict(policy.model)
    assert len(made) > 10 and max(alive_at_start) == 0
    monkeypatch.setattr(lora, "_merged", real)
    layer = next(m for n, m in policy.model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    name = next(n for n in state if n.endswith("layers.0.self_attn.q_proj.weight"))
    assert torch.equal(state[name], real(layer)) and state[name].device.type == "cpu"


def test_adafactor_keeps_far_less_state_than_adamw(policy):
    segs = _segments(policy, n=1, steps=1)
    sizes = {}
    for name in ("adamw", "adafactor"):
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        opt = make_optimizer(name, policy.trainable_parameters(), lr=1e-3, weight_decay=0.0)
        opt.zero_grad()
        (-torch.cat(policy.sequence_logprobs(segs)).mean()).backward()
        opt.step()
        sizes[name] = optimizer_state_bytes(opt)
        changed = any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
        with torch.no_grad():  # put the weights back for the other tests
            for n, p in policy.model.named_parameters():
                p.copy_(before[n])
        policy.model.zero_grad(set_to_none=True)
        assert changed, name
    assert sizes["adafactor"] < 0.25 * sizes["adamw"]
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("lion", policy.trainable_parameters(), lr=1e-3, weight_decay=0.0)


def test_packed_row_equals_padded_rows(policy):
    """Segments of different lengths packed into one row: same log-probs and gradients as
    right-padded rows (the block-diagonal mask keeps them apart)."""
    segs = _segments(policy, n=3, steps=2)
    segs[1] = _segments(policy, n=1, steps=1)[0]  # a shorter one
    assert len({len(s) for s in segs}) > 1
    padded_lp, padded_grads = _logprobs_and_grads(policy, segs)
    policy.model.zero_grad(set_to_none=True)
    packed = policy.sequence_logprobs(segs, pack=True)
    torch.cat(packed).sum().backward()
    for a, b in zip(padded_lp, packed):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    for name, p in policy.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(padded_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    policy.model.zero_grad(set_to_none=True)


def test_frozen_linears_in_bf16_change_no_output_under_autocast(tiny_model):
    """With LoRA under bf16 autocast, storing the frozen Linear weights in bf16 gives the same
    log-probs and adapter gradients as fp32 storage (autocast casts them anyway), in less memory."""
    from arpo_lib.agent.model.lora import cast_frozen_linears

    results = {}
    for frozen in ("float32", "auto"):
        torch.manual_seed(0)
        pol = HFPolicy(tiny_model, device="cpu", compute_dtype="bfloat16", lora_rank=4, frozen_weights_dtype=frozen)
        segs = _segments(pol, n=2, steps=2)
        lps, grads = _logprobs_and_grads(pol, segs)
        size = sum(p.numel() * p.element_size() for p in pol.model.parameters())
        results[frozen] = (lps, grads, size, pol)
    (lp32, g32, size32, _), (lp16, g16, size16, pol16) = results["float32"], results["auto"]
    assert size16 < 0.8 * size32
    assert pol16.model.get_input_embeddings().weight.dtype == torch.float32  # tied LM head (qwen2vl) too
    for a, b in zip(lp32, lp16):
        torch.testing.assert_close(a, b)
    assert g32.keys() == g16.keys() and all("lora_" in k for k in g16)
    for k in g32:
        torch.testing.assert_close(g32[k], g16[k])
    assert cast_frozen_linears(pol16.model, torch.bfloat16) == 0  # idempotent
    assert all(p.dtype == torch.float32 for p in pol16.trainable_parameters())


def test_compiled_decoder_layers_give_the_eager_values_and_can_be_undone(policy):
    """torch.compile of every decoder layer (aot_eager: the traced graphs without generated
    kernels, seconds on a CPU) under activation checkpointing: same log-probs and gradients;
    uncompiling restores the eager forward."""
    from arpo_lib.agent.model.compile import compile_decoder_layers, is_compiled, uncompile_decoder_layers

    segs = _segments(policy, n=1)
    enable_activation_checkpointing(policy.model)
    policy.model.train()
    try:
        eager_lp, eager_grads = _logprobs_and_grads(policy, segs)
        assert compile_decoder_layers(policy.model, backend="aot_eager") == policy.model.config.text_config.num_hidden_layers
        assert is_compiled(policy.model)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled_lp, compiled_grads = _logprobs_and_grads(policy, segs)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers did run compiled
    finally:
        uncompile_decoder_layers(policy.model)
        policy.model.activation_checkpointing_disable()
        policy.model.eval()
    assert not is_compiled(policy.model)
    torch.testing.assert_close(eager_lp[0], compiled_lp[0], atol=1e-5, rtol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(eager_grads[name], compiled_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="no language_model.layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("setting", ["freeze_vision_tower", "lora"])
def test_a_frozen_vision_tower_records_no_graph_under_checkpointing(tiny_qwen25vl, setting):
    """model.freeze_vision_tower (and LoRA, which freezes the tower too): no vision weight gets a
    gradient, the tower's activations are not recorded although activation checkpointing hooks
    the patch embedding to require grad (the hook is dropped), and the language model's gradients
    are exactly those of the trained-tower run (the tower's output does not depend on it)."""
    from arpo_lib.agent.hf_policy import HFPolicy
    from benchmarks.common import synthetic_trajectory

    def run(**kwargs):
        policy = HFPolicy(tiny_qwen25vl, device="cpu", gradient_checkpointing=True, **kwargs)
        policy.model.train()
        seg = synthetic_trajectory(policy, 2, (320, 420))
        visual = policy.model.model.visual if policy.peft_model is None else policy.peft_model.base_model.model.model.visual
        seen = []
        visual.blocks[0].register_forward_hook(lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).requires_grad))
        policy.sequence_logprobs([seg])[0].sum().backward()
        grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
        return seen[0], grads, visual

    recorded, trained, _ = run()
    assert recorded and any(".visual." in n for n in trained)
    recorded, frozen, visual = run(**({"freeze_vision_tower": True} if setting == "freeze_vision_tower" else {"lora_rank": 4}))
    assert not recorded and not any(".visual." in n for n in frozen)
    assert not any(p.requires_grad for p in visual.parameters())
    if setting == "freeze_vision_tower":
        assert frozen.keys() == {n for n in trained if ".visual." not in n}
        for name, grad in frozen.items():
            torch.testing.assert_close(grad, trained[name], atol=0, rtol=0, msg=name)


def test_activation_offload_keeps_the_values_and_sends_the_kept_inputs_through_save_on_cpu(tiny_qwen25vl, monkeypatch):
    """model.activation_offload (transformers' `offload`, torch's save_on_cpu around each
    checkpointed layer): the same log-probs and gradients bit for bit, every checkpointed decoder
    layer's saved tensors packed by save_on_cpu (on a GPU: copied to pinned host memory); without
    checkpointing it is refused."""
    import torch.autograd.graph as graph

    segs = None
    results = {}
    for offload in (False, True):
        policy = HFPolicy(tiny_qwen25vl, device="cpu", gradient_checkpointing=True, activation_offload=offload)
        policy.model.train()
        segs = segs or _segments(policy)
        entered = []
        real_enter = graph.save_on_cpu.__enter__
        monkeypatch.setattr(graph.save_on_cpu, "__enter__", lambda self: entered.append(1) or real_enter(self))
        results[offload] = _logprobs_and_grads(policy, segs), len(entered)
        monkeypatch.undo()
    (lp_off, grads_off), entered_off = results[False]
    (lp_on, grads_on), entered_on = results[True]
    layers = policy.model.config.text_config.num_hidden_layers
    assert entered_off == 0 and entered_on >= layers * len(segs)  # each layer of each forward (and recompute)
    for a, b in zip(lp_off, lp_on):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert grads_off.keys() == grads_on.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_off[name], grads_on[name], atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="needs gradient_checkpointing"):
        HFPolicy(tiny_qwen25vl, device="cpu", activation_offload=True)
