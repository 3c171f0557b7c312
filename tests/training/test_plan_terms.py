"""The planner's terms against what the code holds, measured on the tiny Qwen2.5-VL model on the
CPU under bf16 autocast (the GPU's precision): the checkpointed layer inputs' dtype and bytes,
LoRA's frozen weights, the frozen tower's forward beside live gradients, and a standalone
evaluation's weights and KV caches."""
from __future__ import annotations

import gc

import pytest
import torch

from arpo_lib.training import plan as P
from arpo_lib.types import SamplingParams
from benchmarks.bench_one_gpu import LiveBytes
from benchmarks.common import screenshot


def _segment(policy, shots: int = 1, size=(224, 224)):
    conv = policy.new_conversation("Click the button")
    for i in range(shots):
        conv.add_observation(screenshot(i, size=size))
        if i < shots - 1:
            conv.add_response("Thought: next\nAction: click(start_box='(10,10)')", *_encode(policy))
    return conv.current


def _encode(policy):
    ids = policy.tokenizer("Thought: next\nAction: click(start_box='(10,10)')", add_special_tokens=False)["input_ids"]
    return ids, [0.0] * len(ids)


@pytest.fixture(scope="module")
def shape(tiny_qwen25vl):
    return P.model_shape(str(tiny_qwen25vl))


def test_checkpointed_layer_inputs_are_fp32_with_fp32_masters_and_the_planner_counts_their_bytes(tiny_qwen25vl, shape):
    """Under bf16 autocast the residual stream stays in the masters' dtype: every decoder layer's
    input, what activation checkpointing keeps (and offload pins on the host), is fp32. The
    planner's kept_layer_inputs is those bytes exactly."""
    from arpo_lib.agent.hf_policy import HFPolicy

    policy = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16", gradient_checkpointing=True)
    seg = _segment(policy)
    inputs = []
    layers = next(m for n, m in policy.model.named_modules() if n.endswith("language_model.layers"))
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, k: inputs.append((a[0] if a else k["hidden_states"]).detach()), with_kwargs=True)
        for layer in layers]
    policy.model.train()
    try:
        policy.sequence_logprobs([seg], 1.0)[0].sum().backward()
    finally:
        for h in hooks:
            h.remove()
    first_pass = inputs[:len(layers)]  # the recompute runs each layer again
    assert {t.dtype for t in first_pass} == {torch.float32}
    kept = sum(t.numel() * t.element_size() for t in first_pass)
    w = P.Workload(tokens=len(seg.input_ids), patches=0, trained=1)
    assert P.kept_layer_inputs(shape, w, P.Training(compute_bytes=2)) == kept
    assert P.kept_layer_inputs(shape, w, P.Training(weights_bytes=2)) == kept // 2  # bf16 masters: bf16 inputs


def test_lora_keeps_every_frozen_linear_in_the_compute_dtype_as_the_planner_counts(tiny_qwen25vl, shape):
    """Under LoRA with bf16 compute, `cast_frozen_linears` stores every frozen Linear (the language
    model's projections, the vision tower's, the merger's) in bf16; the planner's resident weights
    are the model's parameter bytes exactly."""
    from arpo_lib.agent.hf_policy import HFPolicy

    policy = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16", lora_rank=4)
    measured = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    vision_linears = [m for n, m in policy.model.named_modules() if "visual" in n and isinstance(m, torch.nn.Linear)]
    assert vision_linears and {m.weight.dtype for m in vision_linears} == {torch.bfloat16}
    planned = P._resident(shape, P.Training(lora_rank=4, frozen_bytes=2, optimizer="none"))["weights"]
    assert planned == measured


def test_the_frozen_towers_forward_beside_live_gradients_is_a_phase_the_planner_holds(tiny_qwen25vl, shape):
    """With the tower frozen, each micro-batch's forward starts with the tower under no_grad while
    the earlier micro-batches' gradients are alive. Measured: live bytes at the end of the
    tower's forward in the second micro-batch (gradients of the first alive), against the
    planner's "update, frozen tower's forward" phase less the resident weights (within 35%, as the
    generation phase: fixed costs at tiny widths)."""
    from arpo_lib.agent.hf_policy import HFPolicy

    policy = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16", gradient_checkpointing=True,
                      freeze_vision_tower=True)
    policy.model.train()
    seg = _segment(policy, shots=2, size=(448, 448))
    policy.sequence_logprobs([seg], 1.0)[0].sum().backward()  # the first micro-batch: its gradients stay
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    weights = list(policy.model.parameters())
    gc.collect()
    tracker = LiveBytes([*weights, *grads])
    at_tower_end = []
    visual = policy.model.model.visual
    hook = visual.register_forward_hook(lambda m, a, out: at_tower_end.append(tracker.live))
    try:
        with tracker:
            policy.sequence_logprobs([seg], 1.0)
    finally:
        hook.remove()
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    measured = max(at_tower_end) - weight_bytes
    patches = sum(int(x.shape[0]) for x in seg.pixel_values)
    w = P.Workload(tokens=len(seg.input_ids), patches=patches, trained=1)
    t = P.Training(freeze_vision=True, optimizer="none", compute_bytes=2, attention_scores=True)
    phase = next(p for p in P.phases(shape, w, t) if p.name == "update, frozen tower's forward")
    planned = phase.total - phase.parts["weights"]
    assert "gradients" in phase.parts and "one vision block's forward" in phase.parts
    assert planned == pytest.approx(measured, rel=0.35), (planned, measured, phase.parts)


def test_an_evaluation_keeps_one_bf16_copy_and_its_episodes_caches_as_the_planner_counts(tiny_qwen25vl, shape):
    """The standalone evaluation's policy (weights in the compute dtype): its parameter bytes are
    the planner's evaluation weights, and the KV caches alive between steps of 2 episodes are its
    "episodes' copies" (within 10%: the responses' lengths vary)."""
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.run.config import load_config

    policy = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16", weights_dtype="compute")
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    convs = [policy.new_conversation(f"Click button {i}") for i in range(2)]
    tracker = LiveBytes(list(policy.model.parameters()))
    for step in range(2):
        for i, conv in enumerate(convs):
            conv.add_observation(screenshot(10 * i + step, size=(224, 224)))
        with tracker:
            out = policy.generate([c.current for c in convs], sampling=SamplingParams(max_new_tokens=8),
                                  seeds=[0, 1], cache_keys=[0, 1])
        for conv, g in zip(convs, out):
            conv.add_response(g.text, g.token_ids, g.logprobs)
    kept = tracker.live - weights
    context = sum(len(e.ids) for e in policy.cached.entries.values()) / 2
    policy.free_generation_memory()
    cfg = load_config("configs/smoke.yaml", ["env.workers=2", "env.envs_per_worker=1"])
    phase = P.evaluation_phase(cfg, shape, (224, 224), device="cuda")  # bf16, as on a GPU
    per_token = phase.parts["KV cache (episodes' copies)"] / (2 * P.workload(cfg, shape, (224, 224)).tokens)
    assert phase.parts["weights"] == weights
    assert kept == pytest.approx(per_token * 2 * context, rel=0.10)


def test_the_plan_says_whether_a_standalone_evaluation_fits():
    """`./workbench plan` on the sandbox's config: UI-TARS-1.5-7B evaluated in process on an
    A100-40GB fits (one bf16 copy, 15.4 GiB, and its KV caches), which the fp32 masters of a
    training run would not."""
    from arpo_lib.run.config import load_config

    cfg = load_config("configs/osworld_sandbox.yaml")
    result = P.plan(cfg, P.parse_memory("A100-40GB"), 1, shape=P.model_shape("ByteDance-Seed/UI-TARS-1.5-7B"))
    e = result.evaluation
    assert e is not None and e.parts["weights"] / P.GIB == pytest.approx(15.4, abs=0.1)
    assert e.total <= P.usable(P.parse_memory("A100-40GB"))
    assert "evaluation (`./workbench eval`" in result.report() and ": fits" in result.report().split("evaluation")[-1]
