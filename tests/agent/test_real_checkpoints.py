"""What real UI-TARS / Qwen-VL checkpoints do that the tiny models must show too: box markers
are special tokens, a generation_config.json with sampling defaults, Qwen2.5-VL-style image
processor configs."""
from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.agent.model.kv_generation import GenerationResult
from arpo_lib.agent.prompt import TokenConversation, load_processor, response_text
from arpo_lib.agent.server_policy import ServerPolicy
from arpo_lib.training.tiny_model import SPECIAL_TOKENS
from arpo_lib.types import PolicyContext, SamplingParams

SAMPLE = SamplingParams(temperature=1.0)

BOXED = "Thought: go\nAction: click(start_box='<|box_start|>(5,6)<|box_end|>')"


def _shot(seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(56, 84, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def policy(tiny_qwen2vl):
    return HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=16)


def _boxed_ids(tokenizer) -> list[int]:
    return tokenizer(BOXED, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


# ---- box markers ----------------------------------------------------------------------------

def test_the_tiny_tokenizers_flag_qwens_special_tokens_as_the_real_one(tiny_model):
    """In Qwen2-VL's tokenizer every one of these is an added token with special=True, and
    `skip_special_tokens` decoding strips them, box markers included."""
    tokenizer = load_processor(tiny_model).tokenizer
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    assert set(SPECIAL_TOKENS) <= special
    ids = _boxed_ids(tokenizer)
    assert "<|box_start|>" not in tokenizer.decode(ids, skip_special_tokens=True)


def test_history_text_keeps_the_sampled_box_markers(policy):
    ids = _boxed_ids(policy.tokenizer)
    text = response_text(policy.tokenizer, ids, policy.eos_ids)
    assert text == BOXED
    assert policy.tokenizer(text, add_special_tokens=False)["input_ids"] == ids[:-1]  # re-encoding gives them back


def test_generated_text_keeps_the_box_markers(policy, monkeypatch):
    ids = _boxed_ids(policy.tokenizer)
    monkeypatch.setattr(policy.cached, "generate", lambda *a, **k: [GenerationResult(ids, [0.0] * len(ids))])
    conv = policy.new_conversation("click")
    conv.add_observation(_shot())
    (gen,) = policy.generate([conv.current], sampling=SAMPLE, seeds=[0], cache_keys=["e"])
    assert gen.text == BOXED


def test_a_history_cut_rerenders_exactly_the_sampled_tokens(policy):
    """After the oldest screenshot drops out, the new segment renders the old responses from
    their text: the box markers must come back as the same special-token ids."""
    conv = TokenConversation(policy.processor, "click", history_images=1)
    ids = _boxed_ids(policy.tokenizer)
    conv.add_observation(_shot(0))
    conv.add_response(response_text(policy.tokenizer, ids, policy.eos_ids), ids, [0.0] * len(ids))
    conv.add_observation(_shot(1))  # history_images=1: a new segment with the response as text
    assert len(conv.segments) == 2
    rerendered = conv.segments[1].input_ids
    box = policy.tokenizer.convert_tokens_to_ids("<|box_start|>")
    assert box in rerendered
    n = len(ids)
    assert any(rerendered[i:i + n] == ids for i in range(len(rerendered) - n + 1))


def test_the_server_policy_sends_the_history_the_model_sampled(tiny_qwen2vl, tmp_path):
    """Against our hf server: a history holding a box-marked response renders to exactly the ids
    the trainer trains on (no prompt mismatch), and the server's text has its markers kept."""
    from arpo_lib.serving.launch import start_server

    with start_server(tiny_qwen2vl, backend="hf", log_path=tmp_path / "s.log", device="cpu") as server:
        server.wait_healthy(timeout_s=300)
        client = ServerPolicy(server.base_url, tiny_qwen2vl, max_new_tokens=12)
        try:
            tokenizer = client.tokenizer
            ids = _boxed_ids(tokenizer)
            conv = client.new_conversation("click the box")
            shots = [_shot(0), _shot(1)]
            conv.add_observation(shots[0])
            conv.add_response(response_text(tokenizer, ids, client.eos_ids), ids, [0.0] * len(ids))
            conv.add_observation(shots[1])
            ctx = PolicyContext("click the box", shots[1], {}, 1, screenshots=shots, responses=list(conv.responses))
            (gen,) = client.generate([conv.current], sampling=SAMPLE, contexts=[ctx], seeds=[3])
            assert client.requests == 1 and client.prompt_mismatches == 0 and client.inexact == 0
            assert gen.text == response_text(tokenizer, gen.token_ids, client.eos_ids)
        finally:
            client.close()


class _OpenAIStub(BaseHTTPRequestHandler):
    """Answers like vLLM with default detokenisation: token ids with box markers, content without."""
    bodies: list = []
    ids: list = []

    def do_GET(self):  # noqa: N802 (/v1/models)
        self._send({"data": [{"id": "stub"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        content = [{"token": "x", "logprob": -0.5} for _ in type(self).ids]
        self._send({"choices": [{"message": {"content": "Thought: go\nAction: click(start_box='(5,6)')"},
                                 "token_ids": type(self).ids, "logprobs": {"content": content},
                                 "finish_reason": "stop"}]})

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_server_answers_are_read_from_their_token_ids_with_neutral_sampling(tiny_qwen2vl):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIStub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = ServerPolicy(f"http://127.0.0.1:{httpd.server_port}/v1", tiny_qwen2vl)
        _OpenAIStub.ids, _OpenAIStub.bodies = _boxed_ids(client.tokenizer), []
        conv = client.new_conversation("click")
        conv.add_observation(_shot())
        ctx = PolicyContext("click", _shot(), {}, 0, screenshots=[_shot()], responses=[])
        (gen,) = client.generate([conv.current], sampling=SamplingParams(temperature=1.0, top_p=0.9),
                                 contexts=[ctx], seeds=[1])
        client.close()
    finally:
        httpd.shutdown()
    assert gen.text == BOXED
    (body,) = _OpenAIStub.bodies
    assert body["skip_special_tokens"] is False and body["repetition_penalty"] == 1.0 and body["top_k"] == -1
    assert body["temperature"] == 1.0 and body["top_p"] == 0.9


# ---- generation_config.json -----------------------------------------------------------------

@pytest.fixture(scope="module")
def penalised_model(tiny_qwen2vl, tmp_path_factory):
    """The tiny model with sampling defaults in its generation_config.json, like Qwen2.5-VL-Instruct's."""
    path = tmp_path_factory.mktemp("gen") / "penalised"
    shutil.copytree(tiny_qwen2vl, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(repetition_penalty=1.5, top_k=1, top_p=0.001, temperature=0.1, no_repeat_ngram_size=2)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_checkpoint_sampling_defaults_change_nothing_and_are_reported(penalised_model, capsys):
    policy = HFPolicy(penalised_model, device="cpu", max_new_tokens=24)
    assert "repetition_penalty=1.5" in capsys.readouterr().out
    HFPolicy(penalised_model, device="cpu")
    assert "repetition_penalty" not in capsys.readouterr().out  # once per checkpoint
    segs = []
    for i in range(4):
        conv = policy.new_conversation("click the button")
        conv.add_observation(_shot(i))
        segs.append(conv.current)
    seeds = list(range(4))
    naive = policy.generate(segs, sampling=SAMPLE, seeds=seeds)  # transformers' generate
    cached = policy.generate(segs, sampling=SAMPLE, seeds=seeds, cache_keys=list(range(4)))  # ours
    for a, b, seg in zip(naive, cached, segs):
        assert a.token_ids == b.token_ids
        scored = seg.__class__(input_ids=seg.input_ids + a.token_ids,
                               mm_token_type_ids=seg.mm_token_type_ids + [0] * len(a.token_ids),
                               loss_mask=[0] * len(seg) + [1] * len(a.token_ids),
                               pixel_values=seg.pixel_values, image_grid_thw=seg.image_grid_thw)
        with torch.no_grad():
            (lp,) = policy.sequence_logprobs([scored], 1.0)
        assert torch.allclose(lp, torch.tensor(a.logprobs), atol=2e-4)  # the distribution sampled from
    assert json.loads((penalised_model / "generation_config.json").read_text())["repetition_penalty"] == 1.5


# ---- image processor configs ----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["size_min_max", "top_level"])
def test_qwen25vl_style_processor_configs_load(tiny_qwen25vl, tmp_path, layout, capsys, monkeypatch):
    """Qwen2.5-VL-7B-Instruct's preprocessor_config.json names Qwen2_5_VLImageProcessor (which
    transformers 5 no longer has) and has no processor_config.json beside it; UI-TARS-style
    configs give the pixel limits either at the top level or as size {min_pixels, max_pixels}."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / layout
    shutil.copytree(tiny_qwen25vl, path)
    (path / "processor_config.json").unlink()
    config = json.loads((path / "preprocessor_config.json").read_text())
    config.update(image_processor_type="Qwen2_5_VLImageProcessor", processor_class="Qwen2_5_VLProcessor")
    del config["size"]
    limits = {"min_pixels": 3136, "max_pixels": 200704}
    if layout == "top_level":
        config.update(limits)
    else:
        config["size"] = limits
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    policy = HFPolicy(path, device="cpu")
    assert "Qwen2_5_VLImageProcessor" in capsys.readouterr().out
    assert policy.resize == (28, 3136, 200704)
    grid = policy.processor.image_processor(images=[Image.new("RGB", (1920, 1080))], return_tensors="pt")["image_grid_thw"]
    h, w = int(grid[0][1]) * 14, int(grid[0][2]) * 14
    assert 3136 <= h * w <= 200704 and abs(w / h - 1920 / 1080) < 0.1
