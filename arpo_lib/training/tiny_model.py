"""Build a tiny, randomly initialised UI-TARS-architecture checkpoint on the local disk.

No weights can be downloaded here, yet the policy code must run through the *real* loading
path. This module writes a directory that loads exactly like a released checkpoint:

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)

Variants (what each one mirrors):

- ``qwen2vl``  -> Qwen2-VL architecture, like UI-TARS-2B-SFT / UI-TARS 1.0. Those checkpoints
  emit coordinates RELATIVE on a 0..1000 grid per axis. Word embeddings are tied to the output
  head, as in Qwen2-VL-2B.
- ``qwen25vl`` -> Qwen2.5-VL architecture, like UI-TARS-1.5-7B (the ARPO checkpoint). It emits
  ABSOLUTE pixel coordinates in the image after ``smart_resize`` (factor 28, the processor's
  min/max pixels). Window attention in the vision tower, untied output head, as in the 7B.

What is real and what is not:

- real: the model classes, config layout, the special tokens with their names and relative order
  (``<|endoftext|>`` ... ``<|video_pad|>``, appended after the ordinary vocabulary as in Qwen),
  the Qwen2 pre-tokenizer (digits split one by one), the Qwen2-VL chat format (including the
  default system turn), image placeholders ``<|vision_start|><|image_pad|><|vision_end|>``,
  ``eos`` = ``<|im_end|>`` / ``<|endoftext|>``, ``pad`` = ``<|endoftext|>``.
- tiny: a byte-level BPE vocabulary of 1,024 tokens (special tokens included) trained on
  UI-TARS-style text, hidden size 64, 2 layers, a 2-block vision tower, and small
  ``min_pixels``/``max_pixels`` so a 480x630 MiniWoB screenshot becomes 108 image tokens
  (resized to 252x336, a 9x12 grid of 28-px cells). Token ids therefore differ from the real
  checkpoints; always look them up through the tokenizer.
- weights are random (seeded). The same seed gives byte-identical weights.

Build it::

    python -m arpo_lib.training.tiny_model --out models/tiny-uitars-qwen2vl --variant qwen2vl
    python -m arpo_lib.training.tiny_model --out models/tiny-uitars-qwen25vl --variant qwen25vl --seed 0

The build goes into a temporary sibling directory that is renamed into place once complete, and
the marker file ``.complete`` is written last, so an interrupted build never leaves a half model.

Gotcha for callers (measured with transformers 5.23): the model needs ``mm_token_type_ids``
(the processor returns it) to place image tokens with M-RoPE; when it is missing with images,
forward raises and ``generate`` silently falls back to 1-D positions. ``generation_config.json``
holds only the eos/pad/bos ids, so transformers' global sampling default ``top_k=50`` applies
unless the caller passes ``top_k=0, top_p=1.0, temperature=...`` explicitly. The random
weights give a near-uniform next-token distribution, so sampling can emit ``<|image_pad|>`` and
other vision tokens; fed back as completion tokens they break the forward pass (image features
and image tokens no longer match). Policies should suppress those ids when sampling.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

VARIANTS = ("qwen2vl", "qwen25vl")

#: Qwen's special tokens, in the order (and so relative id order) of the real tokenizers.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: Marker written last; a model directory without it is not to be trusted.
COMPLETE_MARKER = ".complete"

#: Build record (variant, seed, spec, library versions) saved next to the weights.
BUILD_INFO_FILE = "tiny_model.json"

# Our own Jinja rendering of the Qwen2-VL chat format: a default system turn when the
# conversation does not start with one, `<|im_start|>role\n ... <|im_end|>\n` per turn, each image
# as `<|vision_start|><|image_pad|><|vision_end|>` where it appears among the contents. No
# whitespace-control dashes: the newlines after role names and <|im_end|> are part of the format.
CHAT_TEMPLATE = (
    "{% set ns = namespace(images=0, videos=0) %}"
    "{% if messages and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set ns.images = ns.images + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set ns.videos = ns.videos + 1 %}"
    "{% if add_vision_id %}Video {{ ns.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny checkpoint. Defaults: 364k (qwen2vl) / 446k (qwen25vl) parameters, ~1.5 MB."""

    vocab_size: int = 1024
    """Total tokenizer size, special tokens included (BPE is trained to fill it exactly)."""
    hidden_size: int = 64
    """Text hidden size; also the vision merger's output size."""
    num_hidden_layers: int = 2
    """Text decoder layers."""
    num_attention_heads: int = 2
    """Text attention heads; head_dim = hidden_size / heads must be >= 32 (vLLM)."""
    num_key_value_heads: int = 1
    """Grouped-query KV heads, as in the real models (2B: 12/2, 7B: 28/4)."""
    intermediate_size: int = 128
    """Text MLP width."""
    vision_depth: int = 2
    """Vision transformer blocks."""
    vision_embed_dim: int = 64
    """Vision transformer width."""
    vision_num_heads: int = 2
    """Vision attention heads."""
    vision_intermediate_size: int = 128
    """Vision MLP width (Qwen2.5-VL; Qwen2-VL uses mlp_ratio = this / vision_embed_dim)."""
    min_pixels: int = 28 * 28 * 4
    """Image processor: smallest resized image area (pixels)."""
    max_pixels: int = 28 * 28 * 128
    """Image processor: largest resized image area; 480x630 -> 252x336 -> 108 tokens."""
    max_position_embeddings: int = 32768
    """Context length written into the config."""
    initializer_range: float = 0.02
    """Std of the random normal initialisation."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim < 32 or head_dim % 8:
            raise ValueError(f"text head_dim={head_dim} must be a multiple of 8 and >= 32 (vLLM)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.vision_embed_dim % self.vision_num_heads:
            raise ValueError("vision_embed_dim must be divisible by vision_num_heads")
        if (self.vision_embed_dim // self.vision_num_heads) % 4:
            raise ValueError("vision head_dim must be a multiple of 4 (2-D rotary)")
        if self.vocab_size % 64 or self.vocab_size < 512:
            raise ValueError("vocab_size must be a multiple of 64 and >= 512")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("need 0 < min_pixels <= max_pixels")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mrope_section(self) -> list[int]:
        """(temporal, height, width) rotary split of head_dim/2, in the real 2:3:3 ratio."""
        half = self.head_dim // 2
        temporal = half // 4
        height = (half - temporal) // 2
        return [temporal, height, half - temporal - height]


# ---------------------------------------------------------------------------------------------
# Tokenizer corpus: UI-TARS responses, MiniWoB-style instructions, the computer-use prompt words.
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "button submit ok cancel yes no search text field box input link tab menu item list option "
    "checkbox radio slider date time email name password username login user reply forward "
    "delete trash star archive file folder open close save edit copy paste cut select all "
    "window page scroll up down left right top bottom center next previous first last enter "
    "type click double drag drop press key hold release move mouse shape circle square triangle "
    "red green blue yellow black white color number word letter highlighted the a an of to in on "
    "and or with from into at by for then that this is are it its you your my each every other "
    "find choose pick mark expand collapse toggle widget dialog popup form grid table cell row "
    "column value widget terminal chrome browser desktop screen screenshot icon image label"
).split()

_INSTRUCTIONS = (
    'Click the button.', 'Click on the "{w}" button.', 'Click the link "{w}".',
    'Enter "{w}" into the text field and press Submit.', 'Type "{w}" in the search box.',
    'Select {w} from the list and click Submit.', 'Check the box next to "{w}".',
    'Click on the tab named "{w}".', 'Find the email by {w} and reply to them with the text "{w2}".',
    'Select all the checkboxes with the word "{w}" and click Submit.',
    'Expand the section "{w}" and click the link inside.', 'Drag the {w} item to the top.',
    'Log in with username "{w}" and password "{w2}".', 'Scroll down and click on "{w}".',
    'Double click on the {w} icon.', 'Right click the {w} file and choose Delete.',
    'Select the date {n}/{m}/2024 in the calendar and click Submit.',
    'Use the slider to select the number {n} and click Submit.',
    'Click on the {w} {w2} shape.', 'Open the {w} menu and choose "{w2}".',
)

_THOUGHTS = (
    "I need to click the {w} button to continue.",
    "The {w} field is empty, so I will type the text first.",
    "The task asks me to select {w}. I can see it in the list.",
    "I should scroll down to find the {w} {w2}.",
    "The page shows the {w} dialog. Next I press enter.",
    "Everything is done, the task is complete.",
    "I will wait for the page to load.",
)

_PROMPT = (
    "You are a GUI agent. You are given a task and your action history, with screenshots. "
    "You need to perform the next action to complete the task.\n\n## Output Format\n```\n"
    "Thought: ...\nAction: ...\n```\n\n## Action Space\n\n"
    "click(start_box='<|box_start|>(x1,y1)<|box_end|>')\nleft_double(start_box='(x1,y1)')\n"
    "right_single(start_box='(x1,y1)')\ndrag(start_box='(x1,y1)', end_box='(x3,y3)')\n"
    "hotkey(key='')\ntype(content='') #If you want to submit your input, use \"\\n\" at the end.\n"
    "scroll(start_box='(x1,y1)', direction='down or up or right or left')\n"
    "wait() #Sleep for 5s and take a screenshot to check for any changes.\n"
    "finished(content='xxx')\ncall_user() # Submit the task and call the user when the task is "
    "unsolvable, or when you need the user's help.\n\n## Note\n- Use English in `Thought` part.\n"
    "- Write a small plan and finally summarize your next action (with its target element) in one "
    "sentence in `Thought` part.\n\n## User Instruction\n"
)


def _actions(rng: random.Random, words: list[str]) -> list[str]:
    def pt() -> str:
        return f"({rng.randint(0, 1000)},{rng.randint(0, 1000)})"

    w = rng.choice(words)
    return [
        f"click(start_box='{pt()}')",
        f"click(start_box='<|box_start|>{pt()}<|box_end|>')",
        f"left_double(start_box='{pt()}')",
        f"right_single(start_box='{pt()}')",
        f"drag(start_box='{pt()}', end_box='{pt()}')",
        f"hotkey(key='{rng.choice(['ctrl c', 'ctrl v', 'ctrl a', 'enter', 'tab', 'alt f4'])}')",
        f"type(content='{w}')",
        f"type(content='{w} {rng.choice(words)}\\n')",
        f"scroll(start_box='{pt()}', direction='{rng.choice(['up', 'down', 'left', 'right'])}')",
        "wait()",
        f"finished(content='{w}')",
        "call_user()",
        f"click(start_box='({rng.randint(0, 999)},{rng.randint(0, 999)},"
        f"{rng.randint(0, 999)},{rng.randint(0, 999)})')",
        f"click(point='<point>{rng.randint(0, 999)} {rng.randint(0, 999)}</point>')",
    ]


def tokenizer_corpus(n_samples: int = 600) -> list[str]:
    """Deterministic training text for the BPE (independent of the model seed)."""
    rng = random.Random(0)
    words = list(_WORDS) + [w.capitalize() for w in _WORDS]
    corpus = [_PROMPT, " ".join(_WORDS), "0 1 2 3 4 5 6 7 8 9 " * 4]
    for _ in range(n_samples):
        fill = dict(w=rng.choice(words), w2=rng.choice(words), n=rng.randint(1, 31),
                    m=rng.randint(1, 12))
        action = rng.choice(_actions(rng, words))
        corpus.append(rng.choice(_INSTRUCTIONS).format(**fill))
        corpus.append(f"Thought: {rng.choice(_THOUGHTS).format(**fill)}\nAction: {action}")
    return corpus


def _build_tokenizer(spec: TinyModelSpec):
    """Byte-level BPE trained on the corpus, wrapped as a Qwen2Tokenizer with Qwen's specials."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Same normalisation and pre-tokenisation as the Qwen2 tokenizer, so merges transfer.
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    n_regular = spec.vocab_size - len(SPECIAL_TOKENS)
    trainer = BpeTrainer(vocab_size=n_regular, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    model_state = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model_state["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model_state["merges"]]
    if len(vocab) != n_regular:
        raise RuntimeError(f"BPE trained {len(vocab)} tokens, wanted {n_regular}: enlarge the corpus")
    # Special tokens follow the ordinary vocabulary, in Qwen's order.
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_config(variant: str, spec: TinyModelSpec, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        max_window_layers=spec.num_hidden_layers,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": spec.mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=variant == "qwen2vl",
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=variant == "qwen2vl",
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if variant == "qwen2vl":
        vision = dict(
            depth=spec.vision_depth, embed_dim=spec.vision_embed_dim,
            hidden_size=spec.hidden_size, num_heads=spec.vision_num_heads,
            mlp_ratio=spec.vision_intermediate_size // spec.vision_embed_dim,
            initializer_range=spec.initializer_range,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_embed_dim,
        intermediate_size=spec.vision_intermediate_size, num_heads=spec.vision_num_heads,
        out_hidden_size=spec.hidden_size, window_size=112, tokens_per_second=2,
        fullatt_block_indexes=[spec.vision_depth - 1], initializer_range=spec.initializer_range,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def _build_processor(variant: str, spec: TinyModelSpec, tokenizer):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    pixels = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                  patch_size=14, temporal_patch_size=2, merge_size=2)
    image_processor = Qwen2VLImageProcessor(**pixels)
    video_processor = Qwen2VLVideoProcessor(**pixels)
    cls = Qwen2VLProcessor if variant == "qwen2vl" else Qwen2_5_VLProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer,
               video_processor=video_processor, chat_template=CHAT_TEMPLATE)


def _write_model(tmp: Path, variant: str, seed: int, spec: TinyModelSpec) -> None:
    import tokenizers
    import torch
    import transformers
    from transformers import (GenerationConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLForConditionalGeneration)

    tokenizer = _build_tokenizer(spec)
    processor = _build_processor(variant, spec, tokenizer)
    processor.save_pretrained(tmp)
    # Also the classic per-part files the released checkpoints ship (older loaders read these).
    processor.image_processor.save_pretrained(tmp)
    processor.video_processor.save_pretrained(tmp)
    config = _build_config(variant, spec, tokenizer)
    cls = Qwen2VLForConditionalGeneration if variant == "qwen2vl" else Qwen2_5_VLForConditionalGeneration
    # Seeded CPU float32 init is bit-reproducible; the global RNG state is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = cls(config).to(torch.float32)
    im_end, eot = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    # No sampling defaults: callers pass temperature/top-k/top-p explicitly.
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    model.save_pretrained(tmp)
    info = dict(variant=variant, seed=seed, spec=dataclasses.asdict(spec),
                num_parameters=sum(p.numel() for p in model.parameters()),
                transformers=transformers.__version__, tokenizers=tokenizers.__version__,
                torch=torch.__version__.split("+")[0])
    (tmp / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 768},
}
"""Named TinyModelSpec presets: `tiny` (~0.4M parameters: tests and the smoke run) and `small`
(~3.6M: the learning experiment, configs/learning_miniwob.yaml; the tiny model's sampled
responses are mostly malformed at temperature 1 even after SFT)."""


def build_tiny_model(
    out_dir: str | os.PathLike,
    variant: str = "qwen2vl",
    *,
    seed: int = 0,
    spec: TinyModelSpec | None = None,
    overwrite: bool = False,
    **spec_overrides,
) -> Path:
    """Write a tiny random UI-TARS-architecture checkpoint to ``out_dir`` and return its path.

    ``variant``: "qwen2vl" (UI-TARS 1.0 / 2B-SFT) or "qwen25vl" (UI-TARS-1.5-7B).
    ``spec_overrides``: fields of :class:`TinyModelSpec`, e.g. ``hidden_size=128``.
    The same (variant, seed, spec) gives byte-identical weights. The directory appears
    atomically with ``.complete`` inside; an existing one is replaced only with ``overwrite``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    spec = dataclasses.replace(spec or TinyModelSpec(), **spec_overrides)
    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _write_model(tmp, variant, seed, spec)
        for path in tmp.iterdir():
            path.chmod(0o644)  # save_pretrained leaves some files owner-only
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_complete(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` holds a finished build (the marker is written last)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m arpo_lib.training.tiny_model",
        description="Build a tiny random UI-TARS-architecture checkpoint (no download).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--variant", choices=VARIANTS, default="qwen2vl",
                        help="qwen2vl = UI-TARS 1.0/2B (0..1000 coords); "
                             "qwen25vl = UI-TARS-1.5-7B (absolute coords)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, args.variant, seed=args.seed, overwrite=args.overwrite)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
