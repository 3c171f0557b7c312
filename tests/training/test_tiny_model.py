"""Tests for arpo_lib.tiny_model: the checkpoint loads through the real Auto classes, and the
token-in/token-out recipe the policy relies on holds: log-probs recomputed by one forward pass over
(prompt + sampled completion) equal those seen by `generate`.

The helpers `_generate` and `_completion_logprobs` below are the verified recipe.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from arpo_lib.training.tiny_model import (  # noqa: E402
    COMPLETE_MARKER, SPECIAL_TOKENS, TinyModelSpec, build_tiny_model, is_complete, main,
)

torch.set_num_threads(2)
VARIANTS = ("qwen2vl", "qwen25vl")
EXPECTED_FILES = {
    COMPLETE_MARKER, "config.json", "generation_config.json", "model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "tiny_model.json",
}


def _state_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _file_hash(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _screenshot(seed: int, height: int = 630, width: int = 480) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One build per variant, with its build time."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for variant in VARIANTS:
        start = time.perf_counter()
        path = build_tiny_model(root / variant, variant, seed=0)
        out[variant] = (path, time.perf_counter() - start)
    return out


@pytest.fixture(scope="module", params=VARIANTS)
def loaded(request, built):
    path, _ = built[request.param]
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"  # batched generation needs left padding
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return request.param, processor, model


# --- the recipe ------------------------------------------------------------------------------

def _conversations():
    """Two UI-TARS-like conversations: one screenshot, and a multi-turn one with three."""
    single = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Click the OK button."}]},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    multi = [
        {"role": "user", "content": [{"type": "text", "text": 'Enter "Bob" and press Submit.'}]},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": "Thought: Click the field.\nAction: click(start_box='(120,340)')"},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": "Thought: Type the name.\nAction: type(content='Bob\\n')"},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    images = [[_screenshot(0)], [_screenshot(1), _screenshot(2), _screenshot(3, 400, 300)]]
    return [single, multi], images


def _prompt_inputs(processor, conversations, images):
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in conversations]
    # keys: input_ids, attention_mask, mm_token_type_ids (B, T) and pixel_values (patches, 1176),
    # image_grid_thw (n_images, 3)
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def _generate(model, inputs, *, greedy: bool, max_new_tokens: int = 24, **extra):
    sampling = (dict(do_sample=False) if greedy else
                dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0))  # top_k=0: no default 50
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                              output_logits=True, output_scores=True, **sampling, **extra)


def _completion_mask(completion, eos_ids):
    """1 up to and including the first eos, 0 for the padding generate appends after it."""
    is_eos = torch.isin(completion, torch.tensor(eos_ids))
    return ((is_eos.long().cumsum(1) - is_eos.long()) == 0).long()


def _completion_logprobs(model, inputs, completion, completion_mask):
    """log pi(token) for each completion token, from ONE forward pass over prompt + completion.

    completion, completion_mask: (B, N). Returns (B, N) float32.
    """
    n = completion.shape[1]
    input_ids = torch.cat([inputs["input_ids"], completion], 1)  # (B, P+N)
    attention_mask = torch.cat([inputs["attention_mask"], completion_mask], 1)
    mm_token_type_ids = torch.cat(  # completion tokens are text (0)
        [inputs["mm_token_type_ids"], torch.zeros_like(completion)], 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=mm_token_type_ids, use_cache=False,
                logits_to_keep=n + 1)  # logits only at the last N+1 positions
    logits = out.logits[:, :-1].float()  # (B, N, V): position t predicts completion token t
    return torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)


# --- tests -----------------------------------------------------------------------------------

def test_directory_layout_and_speed(built):
    for variant, (path, seconds) in built.items():
        assert is_complete(path)
        assert EXPECTED_FILES <= {p.name for p in path.iterdir()}, variant
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp dirs left"
        assert seconds < 30, f"{variant} build took {seconds:.1f}s"


def test_build_is_deterministic_and_seed_dependent(built, tmp_path):
    path, _ = built["qwen2vl"]
    again = build_tiny_model(tmp_path / "again", "qwen2vl", seed=0)
    other = build_tiny_model(tmp_path / "other", "qwen2vl", seed=1)
    load = AutoModelForImageTextToText.from_pretrained
    assert _state_hash(load(path)) == _state_hash(load(again)) != _state_hash(load(other))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _file_hash(path / name) == _file_hash(again / name), name
    assert _file_hash(path / "tokenizer.json") == _file_hash(other / "tokenizer.json")


def test_existing_directory_needs_overwrite(built, tmp_path):
    out = build_tiny_model(tmp_path / "m", "qwen25vl", seed=0)
    with pytest.raises(FileExistsError):
        build_tiny_model(out, "qwen25vl")
    assert build_tiny_model(out, "qwen2vl", overwrite=True) == out
    assert '"qwen2_vl"' in (out / "config.json").read_text()
    assert is_complete(out)
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelSpec(hidden_size=64, num_attention_heads=4)


def test_main_cli(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "cli"), "--variant", "qwen25vl", "--seed", "3"]) == 0
    assert is_complete(tmp_path / "cli")
    assert str(tmp_path / "cli") in capsys.readouterr().out


def test_tokenizer_config_and_template(loaded):
    variant, processor, model = loaded
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(ids[0], ids[0] + len(SPECIAL_TOKENS)))  # real order, contiguous
    assert ids[-1] == len(tok) - 1 and model.config.text_config.vocab_size == len(tok)
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    text = "Thought: Click the button.\nAction: click(start_box='(123,456)')"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert "4" in tok.tokenize("(123,456)")  # digits are single tokens, as in Qwen
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
         {"role": "assistant", "content": "ok"}], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>assistant\n")
    head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    assert head_dim >= 32
    assert sum(model.config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    assert model.config.tie_word_embeddings == (variant == "qwen2vl")


def test_screenshot_token_count(loaded):
    _, processor, model = loaded
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"],
                       images=[_screenshot(0)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 24, 18]]  # 14-px patches of 336x252
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 108


def test_multi_turn_inputs_and_forward(loaded):
    _, processor, model = loaded
    conversations, images = _conversations()
    inputs = _prompt_inputs(processor, conversations, images)
    assert {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
            "image_grid_thw"} <= set(inputs.keys())
    grid = inputs["image_grid_thw"]
    assert grid.shape == (4, 3) and inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    image_tokens = (inputs["input_ids"] == model.config.image_token_id)
    per_image = (grid.prod(-1) // 4).tolist()
    assert image_tokens.sum(1).tolist() == [per_image[0], sum(per_image[1:])]
    assert torch.equal(inputs["mm_token_type_ids"].bool(), image_tokens)
    assert (inputs["attention_mask"][:, -1] == 1).all()  # left padding
    with torch.no_grad():
        out = model(**inputs, logits_to_keep=1)
    assert out.logits.shape == (2, 1, model.config.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("greedy,early_eos", [(True, False), (False, False), (False, True)],
                         ids=["greedy", "sampled", "sampled-early-eos"])
def test_forward_logprobs_match_generate(loaded, greedy, early_eos):
    """The central consistency check: training-time log-probs == sampling-time log-probs."""
    _, processor, model = loaded
    conversations, images = _conversations()
    inputs = _prompt_inputs(processor, conversations, images)
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # early_eos: a logit bias on <|im_end|> makes rows stop at different steps, so generate pads
    # the finished row; the bias acts on scores only, the raw logits stay the model's.
    extra = {"sequence_bias": {(im_end,): 3.0}} if early_eos else {}
    torch.manual_seed(0)
    generated = _generate(model, inputs, greedy=greedy, **extra)
    prompt_len = inputs["input_ids"].shape[1]
    completion = generated.sequences[:, prompt_len:]  # (B, N)
    mask = _completion_mask(completion, model.generation_config.eos_token_id)
    if early_eos:
        lengths = mask.sum(1)
        assert lengths.min() < completion.shape[1] and lengths[0] != lengths[1]  # one row padded
    step_logits = torch.stack(generated.logits, 1).float()  # (B, N, V) raw, before processors
    at_generation = torch.log_softmax(step_logits, -1).gather(-1, completion[..., None]).squeeze(-1)
    with torch.no_grad():
        recomputed = _completion_logprobs(model, inputs, completion, mask)
    keep = mask.bool()
    assert torch.allclose(recomputed[keep], at_generation[keep], atol=1e-4, rtol=0)
    if greedy:
        assert torch.equal(completion[keep], step_logits.argmax(-1)[keep])
    elif not early_eos:  # with temperature 1, top_k 0, top_p 1 the scores are the raw logits
        scores = torch.log_softmax(torch.stack(generated.scores, 1).float(), -1)
        assert torch.allclose(scores.gather(-1, completion[..., None]).squeeze(-1)[keep],
                              at_generation[keep], atol=1e-4, rtol=0)

    # Same numbers from the inner model + lm_head at chosen positions (the memory-lean path).
    input_ids = torch.cat([inputs["input_ids"], completion], 1)
    with torch.no_grad():
        hidden = model.model(
            input_ids=input_ids,
            attention_mask=torch.cat([inputs["attention_mask"], mask], 1),
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(mask)], 1),
            use_cache=False,
        ).last_hidden_state[:, prompt_len - 1:-1]  # (B, N, H)
        via_hidden = torch.log_softmax(model.lm_head(hidden).float(), -1)
    via_hidden = via_hidden.gather(-1, completion[..., None]).squeeze(-1)
    assert torch.allclose(via_hidden[keep], at_generation[keep], atol=1e-4, rtol=0)


def test_generate_without_mm_token_type_ids_is_silently_wrong(loaded):
    """Documents the gotcha: always pass the processor's mm_token_type_ids to generate."""
    _, processor, model = loaded
    conversations, images = _conversations()
    inputs = _prompt_inputs(processor, conversations[:1], images[:1])
    with_ids = _generate(model, inputs, greedy=True, max_new_tokens=2)
    without = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    without_ids = _generate(model, without, greedy=True, max_new_tokens=2)
    assert not torch.allclose(with_ids.logits[0], without_ids.logits[0], atol=1e-5)
