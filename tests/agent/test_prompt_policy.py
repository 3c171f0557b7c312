"""Token-exact conversations and the in-process policy, on the real tiny models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_lib.agent.hf_policy import HFPolicy, ModelNotFoundError
from arpo_lib.agent.prompt import build_messages
from arpo_lib.agent.prompt_library import PROMPTS
from arpo_lib.types import SamplingParams
from benchmarks.common import screenshot as _shot


def test_coord_mode_follows_the_architecture(tiny_qwen2vl, tiny_qwen25vl):
    assert HFPolicy(tiny_qwen2vl, device="cpu").coord_mode == "qwen2vl"
    assert HFPolicy(tiny_qwen25vl, device="cpu").coord_mode == "qwen25vl"


def test_missing_model_path_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError, match="workbench setup"):
        HFPolicy("models/tiny-uitars-nonexistent", device="cpu")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        HFPolicy(tmp_path, device="cpu")


@pytest.mark.parametrize("size", [(1920, 1080), (420, 320), (960, 600), (40, 30)])
def test_screenshot_tokens_are_what_the_processor_puts_in_the_context(tiny_qwen2vl, size):
    """The count a config check uses (read from preprocessor_config.json, no processor loaded)
    equals the processor's: its image pads plus <|vision_start|> and <|vision_end|>."""
    from arpo_lib.agent.prompt import checkpoint_image_limits, load_processor, screenshot_tokens

    processor = load_processor(tiny_qwen2vl)
    limits = checkpoint_image_limits(tiny_qwen2vl)
    assert limits == (28, 3136, 100352)
    ids = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[_shot(0, size)],
                    return_tensors="pt")["input_ids"][0].tolist()
    assert screenshot_tokens(size, limits) == len(ids)


def test_a_1080p_screenshot_is_2693_tokens_at_ui_tars_limits_and_unknown_checkpoints_are_none(tmp_path):
    from arpo_lib.agent.prompt import QWEN_DEFAULT_MAX_PIXELS, checkpoint_image_limits, screenshot_tokens

    assert screenshot_tokens((1920, 1080), (28, 3136, QWEN_DEFAULT_MAX_PIXELS)) == 39 * 69 + 2  # 1932 x 1092
    assert screenshot_tokens((1920, 1080), (28, 3136, 2116800)) == 39 * 69 + 2  # ARPO's max_pixels: the same
    assert checkpoint_image_limits(tmp_path) is None
    assert checkpoint_image_limits("nobody-has/this-model") is None  # the hub is not asked
    (tmp_path / "preprocessor_config.json").write_text(  # UI-TARS-1.5's spelling of the limits
        '{"image_processor_type": "Qwen2_5_VLImageProcessor", "size": {"min_pixels": 3136, "max_pixels": 2116800}}')
    assert checkpoint_image_limits(tmp_path) == (28, 3136, 2116800)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_holds_instruction_and_every_action(name):
    text = PROMPTS[name].render("Click OK {not a placeholder}")
    assert text.rstrip().endswith("Click OK {not a placeholder}")
    for kind in ("click(", "left_double(", "right_single(", "drag(", "hotkey(", "type(", "scroll(",
                 "wait(", "finished("):
        assert kind in text
    assert ("call_user(" in text) == (name == "uitars10")  # only UI-TARS 1.0's prompt offers it


def test_history_limit_keeps_text_of_old_steps():
    msgs = build_messages("do it", n_screenshots=4, responses=["r0", "r1", "r2"], history_images=2)
    images = [m for m in msgs if m["role"] == "user" and m["content"][0]["type"] == "image"]
    assistants = [m["content"][0]["text"] for m in msgs if m["role"] == "assistant"]
    assert len(images) == 2 and assistants == ["r0", "r1", "r2"]


def _run_conversation(policy, n_steps, history_images):
    conv = policy.new_conversation("Click the OK button")
    conv.history_images = history_images
    for step in range(n_steps):
        conv.add_observation(_shot(step))
        gen = policy.generate([conv.current], sampling=SamplingParams(temperature=1.0))[0]
        conv.add_response(gen.text, gen.token_ids, gen.logprobs)
    return conv


def test_incremental_tokens_equal_the_chat_template_rendering(policy):
    """Token-in/token-out: ids built turn by turn equal the processor's ids for the whole
    conversation, except that sampled responses keep their sampled ids."""
    torch.manual_seed(1)
    conv = _run_conversation(policy, 3, history_images=15)
    assert len(conv.segments) == 1
    seg = conv.segments[0]
    msgs = build_messages(conv.instruction, 3, conv.responses, 15)
    text = policy.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    ref = policy.processor(text=[text], images=conv.screenshots, return_tensors="pt")
    ref_ids = ref["input_ids"][0].tolist()
    ours = seg.input_ids
    # Before the first sampled token, the ids are the template's ids exactly.
    first = seg.loss_mask.index(1)
    assert ours[:first] == ref_ids[:first]
    # The image structure is identical (each screenshot was processed once, in its own turn).
    assert sum(seg.mm_token_type_ids) == int(ref["mm_token_type_ids"].sum())
    assert torch.equal(torch.cat(seg.pixel_values), ref["pixel_values"])
    assert torch.equal(torch.stack(seg.image_grid_thw), ref["image_grid_thw"])
    # Re-encoding our full id sequence's text gives the reference ids when responses round-trip.
    decoded = policy.tokenizer.decode(ours, skip_special_tokens=False)
    assert decoded.count("<|im_start|>") == text.count("<|im_start|>")
    assert ours[-1] == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_incremental_equals_template_with_fixed_responses(policy):
    """With responses that round-trip through the tokenizer, incremental ids == template ids exactly."""
    conv = policy.new_conversation("Click the OK button")
    responses = ["Thought: ok\nAction: click(start_box='(10,20)')", "Thought: done\nAction: finished()"]
    for step, resp in enumerate(responses):
        conv.add_observation(_shot(step))
        ids = policy.tokenizer.encode(resp, add_special_tokens=False) + [conv.eos_id]
        conv.add_response(resp, ids, [0.0] * len(ids))
    msgs = build_messages(conv.instruction, 2, responses, 15)
    text = policy.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    ref_ids = policy.processor(text=[text], images=conv.screenshots, return_tensors="pt")["input_ids"][0].tolist()
    ours = conv.segments[0].input_ids
    # The template ends the last assistant turn with "<|im_end|>\n"; our ids stop at <|im_end|>.
    assert ref_ids[: len(ours)] == ours
    assert len(ref_ids) - len(ours) <= 1


def test_generate_logprobs_match_training_logprobs(policy):
    """Behaviour log-probs from sampling == log-probs recomputed by the training forward pass."""
    torch.manual_seed(3)
    conv = _run_conversation(policy, 2, history_images=15)
    seg = conv.segments[0]
    recomputed = policy.sequence_logprobs([seg], temperature=1.0)[0]
    stored = torch.tensor([lp for lp, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
    assert recomputed.shape == stored.shape and recomputed.numel() > 0
    assert torch.allclose(recomputed, stored, atol=1e-4), (recomputed - stored).abs().max()


def test_batched_generation_matches_single(policy):
    """Left-padded batch generation gives each row the same greedy tokens as running it alone."""
    convs = []
    for i in range(3):
        conv = policy.new_conversation(f"Task number {i}" + " word" * i)
        conv.add_observation(_shot(10 + i, size=(320 + 56 * i, 420)))
        convs.append(conv)
    batch = policy.generate([c.current for c in convs], sampling=SamplingParams(temperature=0))
    for conv, gen in zip(convs, batch):
        single = policy.generate([conv.current], sampling=SamplingParams(temperature=0))[0]
        assert single.token_ids == gen.token_ids
        assert np.allclose(single.logprobs, gen.logprobs, atol=1e-4)


def test_history_limit_starts_new_segments_that_are_trainable(policy):
    torch.manual_seed(4)
    conv = _run_conversation(policy, 4, history_images=2)
    assert len(conv.segments) == 3  # steps 0-1, then a new rendering at step 2 and at step 3
    for seg in conv.segments:
        assert len(seg.pixel_values) <= 2
        lp = policy.sequence_logprobs([seg])[0]
        stored = torch.tensor([v for v, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
        assert torch.allclose(lp, stored, atol=1e-4)


def test_sequence_logprobs_has_gradient_and_batches(policy):
    torch.manual_seed(5)
    segs = [_run_conversation(policy, 1, 15).segments[0] for _ in range(2)]
    together = policy.sequence_logprobs(segs)
    apart = [policy.sequence_logprobs([s])[0] for s in segs]
    for a, b in zip(together, apart):
        assert torch.allclose(a, b, atol=1e-4)
    together[0].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())
    policy.model.zero_grad()


def test_seeded_sampling_does_not_depend_on_the_batch(policy):
    convs = []
    for i in range(3):
        conv = policy.new_conversation(f"Task {i}")
        conv.add_observation(_shot(20 + i))
        convs.append(conv)
    batch = policy.generate([c.current for c in convs], sampling=SamplingParams(temperature=1.0), seeds=[7, 8, 9])
    alone = policy.generate([convs[1].current], sampling=SamplingParams(temperature=1.0), seeds=[8])[0]
    assert alone.token_ids == batch[1].token_ids
    assert np.allclose(alone.logprobs, batch[1].logprobs, atol=1e-4)
    other = policy.generate([convs[1].current], sampling=SamplingParams(temperature=1.0), seeds=[123])[0]
    assert other.token_ids != alone.token_ids  # a different seed samples something else


def test_gumbel_sampler_samples_the_softmax():
    from arpo_lib.agent.sampling import SeededGumbelSampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    temperature = 0.7
    probs = torch.softmax(logits / temperature, -1)[0]
    n = 6000
    counts = torch.zeros(5)
    sampler = SeededGumbelSampler(range(n), temperature, 1.0, [])
    # One row per seed: the same logits, n independent draws.
    picks = sampler(None, logits.repeat(n, 1)).argmax(-1)
    counts += torch.bincount(picks, minlength=5)
    assert torch.allclose(counts / n, probs, atol=0.02), (counts / n, probs)
    # Suppressed tokens and tokens outside the nucleus are never drawn.
    nucleus = SeededGumbelSampler(range(n), 1.0, 0.6, [1])
    picks = nucleus(None, logits.repeat(n, 1)).argmax(-1)
    # Without token 1, token 0 holds 0.71 of the mass: the 0.6-nucleus is token 0 alone.
    assert set(picks.tolist()) == {0}
