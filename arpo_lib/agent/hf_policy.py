"""The in-process Hugging Face policy: batched generation with behaviour log-probs, and
log-probs of given tokens for training, computed only at assistant-token positions.

Loads any UI-TARS checkpoint (Qwen2-VL or Qwen2.5-VL architecture) the real way:
`AutoProcessor` + `AutoModelForImageTextToText`. The tiny locally built models go through the
same code.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from arpo_lib.agent.model import autocast
from arpo_lib.agent.model.kv_generation import CachedGenerator
from arpo_lib.agent.model.logprobs import LogprobNet, token_logprobs
from arpo_lib.agent.model.lora import (adapter_state_dict, apply_lora, cast_frozen_linears, load_adapter_state_dict,
                                       merged_state_dict)
from arpo_lib.agent.model.packing import pack_segments
from arpo_lib.agent.model.vision_attention import use_batched_vision_attention
from arpo_lib.agent.prompt import (UITarsConversations, coord_mode_for, image_processor_limits, DEFAULT_PROMPT,
                                   get_prompt, load_processor, response_text, special_token_ids)
from arpo_lib.agent.sampling import SeededGumbelSampler
from arpo_lib.types import Generation, SamplingParams, Segment

log = logging.getLogger(__name__)

class FrequencyPenalty:
    """Logits processor: lowers each token's score by `penalty` times its count among the tokens
    generated after position `prompt_width` (OpenAI's frequency_penalty)."""

    def __init__(self, penalty: float, prompt_width: int):
        self.penalty, self.prompt_width = penalty, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_width:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.penalty * counts


SAMPLING_FIELDS = {"temperature": 1.0, "top_k": None, "top_p": 1.0, "min_p": None, "typical_p": 1.0,
                   "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                   "sequence_bias": None, "min_new_tokens": None, "min_length": 0, "epsilon_cutoff": 0.0,
                   "eta_cutoff": 0.0, "exponential_decay_length_penalty": None, "do_sample": False}
"""Generation-config fields that would change which tokens are sampled or their probabilities,
with the values under which they do nothing (top_k 50 with do_sample false is inert too)."""
_REPORTED: set[str] = set()


def checkpoint_sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling settings a checkpoint's generation_config.json sets away from neutral
    (Qwen2.5-VL-Instruct: repetition_penalty 1.05, top_k 1, top_p 0.001, temperature 0.1)."""
    found = {}
    for name, neutral in SAMPLING_FIELDS.items():
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral and not (name == "top_k" and value in (0, 50)):
            found[name] = value
    return found


def report_checkpoint_sampling(path: str, generation_config: Any) -> None:
    """Say once per checkpoint that its generation defaults are not applied."""
    found = checkpoint_sampling_defaults(generation_config)
    if found and path not in _REPORTED:
        _REPORTED.add(path)
        log.info("%s: its generation_config.json sets %s; not applied: rollouts sample exactly as "
                 "rollout.temperature / rollout.top_p say, and the recorded log-probs are of that distribution",
                 path, ", ".join(f"{k}={v}" for k, v in found.items()))


@contextlib.contextmanager
def neutral_generation_defaults(model: Any) -> Iterator[None]:
    """transformers fills every generation setting a call leaves unset from the checkpoint's
    generation_config (a repetition penalty, say), which would sample from other scores than the
    ones the behaviour log-probs are computed from. Inside this block the model's defaults are
    transformers' neutral ones; the checkpoint's are restored after (and saved with the model)."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or is not a checkpoint directory."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFPolicy(UITarsConversations):
    """A UI-TARS policy run in this process with transformers."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        compute_dtype: str = "auto",
        coord_mode: str = "auto",
        history_images: int = 15,
        max_new_tokens: int = 256,
        gradient_checkpointing: bool = False,
        checkpoint_every_n_layers: int = 1,
        activation_offload: bool = False,
        freeze_vision_tower: bool = False,
        kv_cache: bool = True,
        prefill_batch_tokens: int | None = None,
        vision_attention: str = "batched",
        logprob_chunk: int = 1024,
        lora_rank: int = 0,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        lora_seed: int = 0,
        frozen_weights_dtype: str = "auto",
        prompt: str = DEFAULT_PROMPT,
        model: Any = None,
        weights_dtype: str = "float32",
    ):
        from transformers import AutoModelForImageTextToText
        from transformers.utils import logging as hf_logging

        # Loading/saving bars of a tiny model are noise in notebooks; our own messages say what happens.
        hf_logging.disable_progress_bar()
        path = str(path)
        if Path(path).exists() and not (Path(path) / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a model directory (no config.json)")
        if not Path(path).exists() and (path.startswith((".", "/")) or path.startswith("models/")):
            hint = " Run `./workbench setup` to build the tiny models." if "tiny" in path else ""
            raise ModelNotFoundError(f"model path {path} does not exist.{hint}")
        self.path = path
        self.device = resolve_device(device)
        if compute_dtype == "auto":
            compute_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.compute_dtype = getattr(torch, compute_dtype)
        if coord_mode == "auto":
            coord_mode = coord_mode_for(path)
        self.coord_mode = coord_mode
        self.processor = load_processor(path)
        self.tokenizer = self.processor.tokenizer
        # fp32 master weights; bf16 (if asked) only inside autocast. `weights_dtype="compute"`: nothing
        # trains (an evaluation), so one copy in the compute dtype is all a forward needs (7B in bf16:
        # 15.4 GiB instead of 30.9). A ready `model` (the benchmarks' random weights of the real
        # shapes) replaces the checkpoint's; the processor still comes from `path`.
        if weights_dtype not in ("float32", "compute"):
            raise ValueError(f"weights_dtype must be 'float32' or 'compute', not {weights_dtype!r}")
        if weights_dtype == "compute" and (lora_rank or gradient_checkpointing):
            raise ValueError("weights in the compute dtype are for inference: no LoRA, no activation checkpointing")
        if model is None:
            dtype = torch.float32 if weights_dtype == "float32" else self.compute_dtype
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
        self.model = model.to(self.device)
        self.model.eval()
        report_checkpoint_sampling(path, self.model.generation_config)
        if gradient_checkpointing:
            enable_activation_checkpointing(self.model, checkpoint_every_n_layers, offload=activation_offload)
        elif activation_offload:
            raise ValueError("activation offload moves the checkpointed layers' inputs: it needs gradient_checkpointing")
        if freeze_vision_tower:
            set_vision_tower_trainable(self.model, False)
        if vision_attention == "batched":
            use_batched_vision_attention(self.model)
        elif vision_attention != "loop":
            raise ValueError(f"vision_attention must be 'batched' or 'loop', not {vision_attention!r}")
        self.logprob_chunk = logprob_chunk
        self.peft_model = None
        """The PeftModel when LoRA is on (`self.model` is the same network with adapters inside)."""
        if lora_rank > 0:
            self.peft_model = apply_lora(self.model, lora_rank, lora_alpha, lora_dropout, seed=lora_seed)
            drop_frozen_vision_input_grads(self.model)  # the tower is frozen under LoRA
            if frozen_weights_dtype == "auto" and self.compute_dtype != torch.float32:
                cast_frozen_linears(self.model, self.compute_dtype)
        if frozen_weights_dtype not in ("auto", "float32"):
            raise ValueError(f"frozen_weights_dtype must be 'auto' or 'float32', not {frozen_weights_dtype!r}")
        self.history_images = history_images
        self.prompt = get_prompt(prompt)
        self.max_new_tokens = max_new_tokens
        self.eos_ids, self.suppress_ids = special_token_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[-1]
        self.resize = image_processor_limits(self.processor)
        self.kv_cache = kv_cache
        self.cached = CachedGenerator(self, "auto" if prefill_batch_tokens is None else prefill_batch_tokens)
        """Per-episode KV caches for rollouts (used when `generate` gets `cache_keys`)."""

    def release(self, key: Any) -> None:
        """Forget an episode's KV cache (the rollout engine calls this when an episode ends)."""
        self.cached.release(key)

    def free_generation_memory(self) -> None:
        """After a rollout batch, before the update: forget every episode's KV cache (an episode
        that ended on an infrastructure failure may not have released its own), and on a GPU hand
        the allocator's cached blocks back, so the update's activations are not refused memory that
        the rollouts' caches left split into blocks of the wrong sizes."""
        self.cached.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def autocast(self):
        """The forward-pass precision context (`model.compute_dtype` over fp32 weights).

        Autocast's cast cache is kept only where a backward will use it. A forward without
        gradients (generation, the update's old log-probs) has none, yet the weights still
        require grad, so the cache would hold a bf16 copy of the whole model beside the fp32 one
        until the context exits: through the whole of `model.generate`, through every prefill
        and decode step of the KV-cached path (7B: ~14 GiB beside 30.9 GiB). Without
        it one weight's copy exists at a time; each forward casts the weights it uses again
        (as the KV-cached path's decode steps already did, one context per step)."""
        return autocast(self.device, self.compute_dtype, keep_casts=torch.is_grad_enabled())

    # -- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        segments: Sequence[Segment],
        *,
        sampling: SamplingParams = SamplingParams(),
        contexts: Sequence[Any] | None = None,
        seeds: Sequence[int] | None = None,
        cache_keys: Sequence[Any] | None = None,
    ) -> list[Generation]:
        """Sample one response for each context (batched, left-padded).

        Temperature 0 = greedy. Otherwise each row samples from softmax(logits / T) (nucleus-
        truncated when top_p < 1) with ITS OWN random generator seeded by `seeds[row]` (drawn
        from torch's global generator when not given): a row's sample does not depend on which
        other episodes share the batch, so runs and resumes are reproducible whatever order the
        environments answer in. Behaviour log-probs are log softmax(logits / T) of the sampled
        tokens (T = 1 for greedy; the nucleus truncation is not reflected in them).
        `contexts` (instruction, screenshot, env info per episode) is unused here: the model
        sees only the tokens. Scripted policies read it.

        `cache_keys` (one per live episode, e.g. from the rollout engine) switch on the KV-cached
        path of `arpo_lib.agent.model.kv_generation` (when `kv_cache` is on): each episode's keys and
        values are kept between calls and only its new tokens are prefilled. Without keys, or with
        `kv_cache=False`, the whole sequence is prefilled (the naive path).

        `sampling.frequency_penalty` (an evaluation protocol's, OpenAI's meaning): each token's
        logit is lowered by this times its count in the response so far; the behaviour log-probs
        are of the penalised distribution.
        """
        from transformers import GenerationConfig, LogitsProcessorList

        if not segments:
            return []
        temperature, top_p, frequency_penalty = sampling.temperature, sampling.top_p, sampling.frequency_penalty
        max_new_tokens = sampling.max_new_tokens or self.max_new_tokens
        if self.kv_cache and cache_keys is not None:
            out = self.cached.generate(segments, cache_keys, temperature=temperature, top_p=top_p,
                                       max_new_tokens=max_new_tokens, seeds=seeds, frequency_penalty=frequency_penalty)
            return [Generation(response_text(self.tokenizer, r.token_ids, self.eos_ids), r.token_ids, r.logprobs)
                    for r in out]
        batch = pad_segments(segments, self.pad_id, side="left")
        batch.pop("loss_mask")
        width = batch["input_ids"].shape[1]
        inputs = {k: v.to(self.device) for k, v in batch.items()}
        greedy = temperature <= 0
        processors = LogitsProcessorList()
        if frequency_penalty:
            processors.append(FrequencyPenalty(frequency_penalty, width))
        if not greedy:
            if seeds is None:
                seeds = torch.randint(0, 2**31 - 1, (len(segments),)).tolist()
            processors.append(SeededGumbelSampler(seeds, temperature, top_p, self.suppress_ids))
        # Decoding is greedy over (possibly Gumbel-perturbed) scores: argmax of
        # logits/T + Gumbel noise is an exact sample from softmax(logits/T).
        gen_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids or None, return_dict_in_generate=True, output_logits=True,
        )
        with self.autocast(), neutral_generation_defaults(self.model):
            out = self.model.generate(**inputs, generation_config=gen_config, logits_processor=processors)
        new_tokens = out.sequences[:, width:]  # (B, N)
        logits = torch.stack(out.logits, dim=1).float()  # (B, N, V) raw logits
        if self.suppress_ids:  # the behaviour distribution excludes them, as sampling did
            logits[..., self.suppress_ids] = float("-inf")
        if frequency_penalty:  # ... and is penalised as it was: counts of the tokens before each step
            counts = torch.zeros_like(logits[:, 0])  # (B, V)
            rows = torch.arange(logits.shape[0])
            for t in range(logits.shape[1]):
                logits[:, t] -= frequency_penalty * counts
                counts[rows, new_tokens[:, t]] += 1
        scale = 1.0 if greedy else temperature
        logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        for row in range(len(segments)):
            toks = new_tokens[row].tolist()
            n = len(toks)
            for i, t in enumerate(toks):
                if t in self.eos_ids:
                    n = i + 1
                    break
            toks = toks[:n]
            text = response_text(self.tokenizer, toks, self.eos_ids)
            results.append(Generation(text=text, token_ids=toks, logprobs=logprobs[row, :n].tolist()))
        return results

    # -- training --------------------------------------------------------------------------
    def sequence_logprobs(self, segments: Sequence[Segment], temperature: float = 1.0,
                          pack: bool = False, model: Any = None) -> list[torch.Tensor]:
        """Log-probs (with grad) of every loss-masked token of each segment: a list of (n_i,) tensors.

        Runs the decoder once per micro-batch and applies the LM head only at the positions that
        predict a trained token, `logprob_chunk` positions at a time (arpo_lib.agent.model.logprobs):
        full-vocabulary logits over a multi-image sequence never exist. `pack` puts the segments
        end to end in one row instead of right-padded rows (arpo_lib.agent.model.packing).
        `model`: another network of the same architecture (the frozen KL reference) instead of ours,
        or the FSDP-sharded `LogprobNet` of distributed training (one module call for the forward).
        """
        model = model if model is not None else self.model
        sharded = isinstance(model, LogprobNet)  # the FSDP copy of distributed training
        if pack and len(segments) > 1:
            batch = pack_segments(self.model if sharded else model, segments)
        else:
            batch = pad_segments(segments, self.pad_id, side="right")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        targets = batch.pop("loss_mask").bool()  # (B, T)
        token_lp = model(batch, targets, temperature) if sharded else self.forward_logprobs(model, batch, targets,
                                                                                             temperature)
        counts = [sum(seg.loss_mask) for seg in segments]
        return list(torch.split(token_lp, counts))

    def forward_logprobs(self, model: Any, batch: dict[str, torch.Tensor], targets: torch.Tensor,
                         temperature: float) -> torch.Tensor:
        """The training forward: the decoder over a padded or packed `batch`, then the LM head only
        at the positions that predict a `targets` token -> their log-probs, (N,)."""
        with self.autocast():
            hidden = model.model(**batch, use_cache=False).last_hidden_state  # (B, T, H)
        # hidden at t-1 predicts token t (never across a packed boundary: a segment's first token is not trained)
        pred_mask = torch.zeros_like(targets)
        pred_mask[:, :-1] = targets[:, 1:]
        selected = hidden[pred_mask]  # (N, H)
        tokens = batch["input_ids"][targets]  # (N,)
        with self.autocast():
            return token_logprobs(selected, tokens, model.lm_head, temperature=temperature,
                                  suppress_ids=self.suppress_ids, chunk=self.logprob_chunk)

    # -- persistence -----------------------------------------------------------------------
    def load_adapter(self, directory: str | Path) -> None:
        """Load the LoRA adapter a `save` wrote (resume: base weights + this adapter)."""
        if self.peft_model is None:
            raise ValueError("this policy has no LoRA adapter (model.lora_rank is 0)")
        load_adapter_state_dict(self.peft_model, torch.load(Path(directory) / "adapter.pt", weights_only=True))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: all weights, or only the LoRA adapters."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Save model + processor in the Hugging Face layout (loadable by this class, vLLM, ...).
        With LoRA the weights are saved merged, and the adapter alone goes to adapter.pt.
        `state_dict`: the weights to write instead of the model's own, by parameter name (a
        distributed run whose ranks keep only shards gathers them; the model may be on the meta
        device then: transformers takes the names, configuration and tied weights from it)."""
        directory = Path(directory)
        if state_dict is not None:
            if self.peft_model is not None:
                raise ValueError("save(state_dict=...) is for full fine-tuning; a LoRA policy saves its own weights")
            self.model.save_pretrained(directory, state_dict=state_dict)
        elif self.peft_model is None:
            self.model.save_pretrained(directory)
        else:
            self.model.save_pretrained(directory, state_dict=merged_state_dict(self.model))
            torch.save(adapter_state_dict(self.peft_model), directory / "adapter.pt")
        self.processor.save_pretrained(directory)
        (directory / "arpo_policy.json").write_text(json.dumps({"coord_mode": self.coord_mode}))


def enable_activation_checkpointing(model: Any, every_n_layers: int = 1, offload: bool = False) -> None:
    """Recompute decoder-layer activations in backward, every `every_n_layers`-th layer (1 = all:
    least memory; larger = less recomputation). Non-reentrant: works with frozen inputs (LoRA) and
    with the checkpointed log-prob chunks. `offload`: the activations kept for the recompute wait in
    pinned host memory (less GPU memory, a copy each way)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(kwargs, every_n_layers=every_n_layers, offload=offload)
    elif every_n_layers != 1 or offload:
        raise ValueError("model.checkpoint_every_n_layers > 1 and activation offload need transformers >= 5.23")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    drop_frozen_vision_input_grads(model)


def set_vision_tower_trainable(model: Any, trainable: bool) -> None:
    """Train, or freeze, the whole vision module of a Qwen2-VL / Qwen2.5-VL model (patch embedding,
    blocks and the merger into the language model), as EasyR1's `freeze_vision_tower` does."""
    model.model.visual.requires_grad_(trainable)
    drop_frozen_vision_input_grads(model)


def drop_frozen_vision_input_grads(model: Any) -> int:
    """Remove transformers' hook that makes the patch embedding's output require grad when the
    vision module has nothing to train (frozen, or LoRA on the language model); returns how many.

    Activation checkpointing turns on `enable_input_require_grads`, which hooks every sub-model's
    input embeddings, the vision patch embedding included: a frozen tower then still records its
    whole graph, keeps its activations and runs its backward for gradients that go nowhere. Our
    checkpointing is non-reentrant, which needs no input that requires grad."""
    visual = next((m for m in model.modules() if hasattr(m, "patch_embed") and hasattr(m, "blocks")), None)
    if visual is None or any(p.requires_grad for p in visual.parameters()):
        return 0
    # By the hook's name: a second `enable_input_require_grads` (peft's, when it wraps a model that
    # checkpoints) replaces the list of handles and leaves the first hook untracked.
    hooks = visual.patch_embed._forward_hooks
    stale = [key for key, fn in hooks.items() if getattr(fn, "__name__", "") == "make_inputs_require_grads"]
    for key in stale:
        del hooks[key]
    return len(stale)


def disable_activation_checkpointing(model: Any) -> None:
    if hasattr(model, "activation_checkpointing_disable"):  # transformers >= 5.23
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def pad_segments(segments: Sequence[Segment], pad_id: int, side: str) -> dict[str, torch.Tensor]:
    """Batch segments for the model: (B, T) ids / attention / mm types / loss mask padded on
    `side` ("left" for generation, "right" for training), images concatenated in batch order."""
    width = max(len(s) for s in segments)
    n = len(segments)
    out = {
        "input_ids": torch.full((n, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((n, width), dtype=torch.long),
        "mm_token_type_ids": torch.zeros((n, width), dtype=torch.int),
        "loss_mask": torch.zeros((n, width), dtype=torch.long),
    }
    for row, seg in enumerate(segments):
        cols = slice(width - len(seg), width) if side == "left" else slice(0, len(seg))
        out["input_ids"][row, cols] = torch.tensor(seg.input_ids)
        out["attention_mask"][row, cols] = 1
        out["mm_token_type_ids"][row, cols] = torch.tensor(seg.mm_token_type_ids, dtype=torch.int)
        out["loss_mask"][row, cols] = torch.tensor(seg.loss_mask)
    pixels = [p for s in segments for p in s.pixel_values]
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.stack([g for s in segments for g in s.image_grid_thw])
    return out
