"""What a run asks of a GPU before the arithmetic: the model's shape (`model_shape`: its parameter
counts, `count`, and its widths, from its config.json or the published values of the models the
configs name, cached per path) and the workload of one training step (`workload`: sequences,
tokens, screenshots and episodes per GPU, from the run's config). The planner
(`training/plan.py`) counts bytes from these.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESPONSE_TOKENS = 128
"""Tokens of a typical response in a trained trajectory (the cap, `model.max_new_tokens`, bounds
each generation step's slab; a trajectory whose every response reaches a cap of 4096 is rare)."""
TURN_TEXT_TOKENS = 30
"""Text tokens of a step besides its screenshot and response (role markers, vision start/end)."""
PROMPT_TOKENS = 300
"""The system prompt and the instruction."""


# Published config.json values of the models the configs name, for a machine that has not
# downloaded them (a local directory or the Hugging Face cache is read first).
PUBLISHED = {
    "qwen2_vl": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True,
                     vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)),
    "qwen2_5_vl": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False,
                       vision=dict(depth=32, hidden_size=1280, out_hidden_size=3584, num_heads=16,
                                   intermediate_size=3420, fullatt_block_indexes=[7, 15, 23, 31], window_size=112)),
}
KNOWN_MODELS = {
    "ByteDance-Seed/UI-TARS-1.5-7B": "qwen2_5_vl",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "bytedance-research/UI-TARS-2B-SFT": "qwen2_vl",
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
}


# ---- the model and the workload -----------------------------------------------------------------

@dataclass(frozen=True)
class Counts:
    """Parameter counts of a model that decide its update's memory."""

    total: int
    root: int
    """Outside every decoder layer and vision block (embeddings, LM head, final norm, merger)."""
    largest_unit: int
    """The largest decoder layer or vision block."""
    text_linear: int
    """Weights of the language model's Linear layers (stored in bf16 when frozen under LoRA)."""
    factored: int
    """Adafactor's state: rows + cols per matrix, the size of every vector parameter."""
    lora_per_rank: int
    """LoRA adapter parameters per unit of rank: sum of (in + out) over the target projections."""
    vision: int = 0
    """The vision module's parameters (blocks and merger): frozen with `model.freeze_vision_tower`."""
    frozen_linear: int = 0
    """Parameters of every nn.Linear but a tied LM head (weights and biases): what LoRA leaves frozen
    and `lora.cast_frozen_linears` stores in the compute dtype (the language model's projections,
    the vision tower's, the merger's, an untied LM head)."""


def count(model: Any) -> Counts:
    """Counts of a (meta-device) Qwen2-VL / Qwen2.5-VL model."""
    import torch

    from arpo_lib.agent.model.lora import LORA_TARGETS
    from arpo_lib.training.distributed import shard_units

    units = shard_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    params = list(model.parameters())
    text_linear = lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "language_model.layers" in name:
            text_linear += module.weight.numel()
            if name.rsplit(".", 1)[-1] in LORA_TARGETS:
                lora += module.in_features + module.out_features
    visual = getattr(getattr(model, "model", model), "visual", None)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) not in embeddings
                 for p in m.parameters(recurse=False))
    return Counts(frozen_linear=linear, total=sum(p.numel() for p in params),
                  root=sum(p.numel() for p in params if id(p) not in in_units),
                  largest_unit=max(sum(p.numel() for p in u.parameters()) for u in units),
                  text_linear=text_linear,
                  factored=sum(sum(p.shape[-2:]) if p.dim() >= 2 else p.numel() for p in params),
                  lora_per_rank=lora,
                  vision=sum(p.numel() for p in visual.parameters()) if visual is not None else 0)


@dataclass(frozen=True)
class ModelShape:
    """What of a model decides its memory: parameter counts and the widths activations scale with."""

    model_type: str
    """`qwen2_vl` or `qwen2_5_vl`."""
    counts: Counts
    largest_param: int
    """Elements of the largest parameter (the weight push gathers one at a time)."""
    largest_text_linear: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_depth: int
    vision_embed: int
    vision_intermediate: int
    patch: int
    merge: int

    @property
    def params(self) -> int:
        return self.counts.total


def model_config(path: str) -> Any:
    """The transformers config of `path`: a local directory, else the Hugging Face cache, else the
    published values of a model the workbench knows (KNOWN_MODELS). Nothing is downloaded."""
    from transformers import AutoConfig, Qwen2_5_VLConfig, Qwen2VLConfig

    if (Path(path) / "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        pass
    if path not in KNOWN_MODELS:
        raise FileNotFoundError(f"model.path {path!r}: no config.json here or in the Hugging Face cache, and not "
                                f"one of {sorted(KNOWN_MODELS)}: download it first (only config.json is read)")
    kind = KNOWN_MODELS[path]
    values = dict(PUBLISHED[kind])
    vision = values.pop("vision")
    text = dict(values, max_window_layers=values["num_hidden_layers"],
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    cls = Qwen2_5_VLConfig if kind == "qwen2_5_vl" else Qwen2VLConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=values["tie_word_embeddings"])


def model_shape(path: str) -> ModelShape:
    """`path`'s shape, from its config on the meta device (a few seconds at 7B)."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = model_config(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    text, vision = config.get_text_config(), config.vision_config
    embed = getattr(vision, "embed_dim", None) or vision.hidden_size
    heads = text.num_attention_heads
    largest_linear = max((m.weight.numel() for n, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear) and "language_model.layers" in n), default=0)
    return ModelShape(
        model_type=config.model_type, counts=count(model),
        largest_param=max(p.numel() for p in model.parameters()), largest_text_linear=largest_linear,
        layers=text.num_hidden_layers, hidden=text.hidden_size,
        intermediate=text.intermediate_size, heads=heads, kv_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size,
        vision_depth=vision.depth, vision_embed=embed,
        vision_intermediate=getattr(vision, "intermediate_size", None) or int(embed * vision.mlp_ratio),
        patch=vision.patch_size, merge=vision.spatial_merge_size)


def cache_dir() -> Path:
    """Where shapes are kept between calls (~/.cache/arpo-workbench/plan, or $ARPO_PLAN_CACHE)."""
    import os

    return Path(os.environ.get("ARPO_PLAN_CACHE", Path.home() / ".cache" / "arpo-workbench" / "plan"))


def cached_shape(path: str) -> ModelShape:
    """`model_shape`, kept in `cache_dir()` keyed by the config's content: a repeat is instant."""
    import hashlib

    config = model_config(path)
    # a new field makes a new key: a file of another layout is never read
    fields = ",".join(f.name for kind in (ModelShape, Counts) for f in dataclasses.fields(kind))
    key = hashlib.sha256((fields + config.to_json_string(use_diff=False)).encode()).hexdigest()[:16]
    file = cache_dir() / f"shape-{key}.json"
    if file.is_file():
        stored = json.loads(file.read_text())
        return ModelShape(**{**stored, "counts": Counts(**stored["counts"])})
    shape = model_shape(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(dataclasses.asdict(shape)) + "\n")
    return shape


def screenshot_tokens(shape: ModelShape, size: tuple[int, int], max_pixels: int = 16384 * 28 * 28) -> int:
    """LM tokens of one screenshot at `size` (W, H) under UI-TARS's pixel limits (smart resize to
    multiples of patch x merge; a 1080p screenshot is not downscaled: 2,691 tokens)."""
    unit = shape.patch * shape.merge
    w, h = size
    if w * h > max_pixels:
        scale = math.sqrt(max_pixels / (w * h))
        w, h = w * scale, h * scale
    return max(1, round(w / unit)) * max(1, round(h / unit))


def default_screen(cfg: Any) -> tuple[int, int]:
    """The screenshot size of the config's tasks: `env.options.screen_size` where set (OSWorld, the
    sandbox), MiniWoB++'s 160x210 task area at `env.options.scale` (3 by default: 480x630) when every
    task is MiniWoB's, else a 1080p desktop."""
    if cfg.env.options.get("screen_size"):
        width, height = cfg.env.options["screen_size"]
        return int(width), int(height)
    if cfg.env.tasks and all(t.startswith("miniwob/") for t in cfg.env.tasks):
        scale = int(cfg.env.options.get("scale", 3))
        return 160 * scale, 210 * scale
    return 1920, 1080


@dataclass(frozen=True)
class Workload:
    """One trajectory as the update sees it, and the generation batch."""

    tokens: int
    """Tokens of one trajectory (every kept screenshot, the text, the responses)."""
    patches: int
    """Vision patches of its screenshots (tokens x merge^2 per screenshot)."""
    trained: int
    """Response tokens (the LM head's positions)."""
    rows: int = 1
    """Trajectories per micro-batch."""
    generation_rows: int = 0
    """Episodes live at once on one GPU, each keeping its KV cache between steps (0: generation
    is not on these GPUs): its share of the batch, at most its environments."""
    generation_batch: int = 0
    """Episodes in one generate call (the step's slab): the live ones, or `rollout.max_batch` in async mode."""
    generation_context: int = 0
    """Tokens of an episode's context at its last step."""
    max_new_tokens: int = 0
    """The response cap (the slab's extra room)."""
    prefill_tokens: int = 0
    """Tokens prefilled in one forward (new turns of a group of rows)."""
    prefill_patches: int = 0


def workload(cfg: Any, shape: ModelShape, screen: tuple[int, int] | None = None, gpus: int = 1) -> Workload:
    """The workload a config asks for: `model.history_images` screenshots of `screen` kept per
    trajectory (at most `env.max_steps`), responses of RESPONSE_TOKENS (at most the cap)."""
    steps = cfg.env.max_steps
    images = min(cfg.model.history_images, steps)
    per_image = screenshot_tokens(shape, screen or default_screen(cfg))
    response = min(cfg.model.max_new_tokens, RESPONSE_TOKENS) + 1
    tokens = PROMPT_TOKENS + images * per_image + steps * (TURN_TEXT_TOKENS + response)
    patches = images * per_image * shape.merge ** 2
    if cfg.train.token_budget:
        rows = max(1, cfg.train.token_budget // tokens)
    else:
        rows = cfg.train.micro_batch_size
    gen_rows = gen_batch = 0
    if cfg.rollout.backend == "hf":  # each process plays its share of the episodes on its own environments
        share = math.ceil(cfg.train.tasks_per_batch * cfg.rollout.group_size / gpus)
        environments = math.ceil(cfg.env.workers / gpus) * cfg.env.envs_per_worker
        gen_rows = gen_batch = min(share, environments)
        if cfg.rollout.mode == "async" and cfg.rollout.max_batch:
            gen_batch = min(gen_rows, cfg.rollout.max_batch)
    budget = cfg.model.prefill_batch_tokens
    budget = 8192 if budget is None else budget
    turn = per_image + TURN_TEXT_TOKENS + response
    group = max(1, min(gen_batch, budget // turn)) if gen_batch else 0
    prefill_tokens, prefill_patches = group * turn, group * per_image * shape.merge ** 2
    if gen_batch and images < steps and tokens > prefill_tokens:
        # the screenshot window slides: from step `images` + 1 on, each step's context is a new
        # segment whose cache is not reused, prefilled whole (one row over the budget goes alone)
        prefill_tokens, prefill_patches = tokens, patches
    return Workload(tokens=tokens, patches=patches, trained=steps * response, rows=rows,
                    generation_rows=gen_rows, generation_batch=gen_batch, generation_context=tokens,
                    max_new_tokens=cfg.model.max_new_tokens, prefill_tokens=prefill_tokens,
                    prefill_patches=prefill_patches)


