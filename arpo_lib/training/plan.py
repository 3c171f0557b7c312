"""The planner: before a run, each phase's peak memory per GPU, whether it fits, and what to change.

    ./workbench plan --config configs/osworld_sandbox.yaml --gpu-memory 40GB [--gpus 1] [--write fits.yaml]

From the model's config.json (no weights: the model is built on torch's meta device and its
parameters counted) and the run's config, in bytes per GPU, for the phases of one training step:

- generation (in-process rollouts, `rollout.backend=hf`): what stays resident (weights, the
  optimizer's state) + the KV cache + one prefill's working set. The cache is counted twice over:
  each episode's compact copy and the step's batch slab of every row (kv_generation.py releases
  an episode's old copy once its row is in the slab), both in the compute dtype (bf16 on a GPU).
  Per token: layers x 2 x kv_heads x head_dim x 2 bytes. The copies: every
  live episode of this GPU (its share of tasks_per_batch x group_size, at most its environments:
  env.workers / GPUs x envs_per_worker; fewer workers is the lever); the slab: those generating
  together (all of them, or `rollout.max_batch` in async mode). With
  `rollout.backend=server` generation runs in the servers' own processes, not on these GPUs.
- old log-probs: resident + one micro-batch's forward without gradients.
- update: resident + gradients + one micro-batch's forward and backward (activations).
- weight push (server mode): resident + the largest trainable tensor gathered whole in bf16 (and,
  over rollout.stream_backend=nccl, the one being sent beside it: the pass runs one ahead on a GPU).

The activations of one micro-batch are counted per token and per vision patch, with activation
checkpointing as the trainer runs it: each decoder layer's and vision block's input kept (bf16),
plus one layer's recomputed working set and the LM head's chunk of logits. Their coefficients
(`ACTIVATION_COEFFICIENTS`) come from the H100 runs committed in benchmarks/results
(update_7b_15shots*.json, update_2b_15shots*.json): the planner reproduces those peaks within 10%
(tests/training/test_plan.py), and that is all the confidence it claims. It cannot see the
allocator's fragmentation, kernels' workspaces or the CUDA context: the budget it fits against
is the card's memory less `RESERVE_BYTES` and `FRAGMENTATION`. What one step holds, measured
through the training code on fake tensors, is `training/memory_model.py` (`measure`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from arpo_lib.training.memory_model import measure  # noqa: F401 (`plan --measure` checks a plan by it)
from arpo_lib.training.workload import (  # noqa: F401 (the planner's names, as before)
    ModelShape, model_config, model_shape, cache_dir, cached_shape, screenshot_tokens,
    default_screen, Workload, workload, RESPONSE_TOKENS, TURN_TEXT_TOKENS, PROMPT_TOKENS,
    PUBLISHED, KNOWN_MODELS,
)

GIB = 2 ** 30
RESERVE_BYTES = 1.5 * GIB
"""The CUDA context, cuBLAS and attention workspaces: memory the card has that tensors never get."""
FRAGMENTATION = 0.05
"""Share of the card kept free for the caching allocator's fragmentation."""
ACTIVATION_COEFFICIENTS = {
    "text_working": 2.67,
    "qwen2_5_vl": 2.22,
    "qwen2_vl": 3.05,
    "lora_unexplained": 13.3,
}
"""Fitted to the H100 runs (module docstring). `text_working`: bytes per token per (hidden +
intermediate) element of the one decoder layer recomputed in the backward; `lora_unexplained`:
what the one LoRA run (r16) held beyond every counted term, per token and (hidden + intermediate)
element: a margin, not a mechanism. The others: bytes per
vision patch per (depth x embed) element of the vision tower's kept activations, by architecture
(Qwen2-VL attends over a whole screenshot in every block, Qwen2.5-VL in windows)."""

# ---- the arithmetic -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Training:
    """What of the config decides the update's memory."""

    lora_rank: int = 0
    """model.lora_rank (0: a full fine-tune)."""
    optimizer: str = "adamw"
    """train.optimizer, or `none` (a forward and backward without a step: the benchmarks' fwd+bwd)."""
    freeze_vision: bool = False
    """model.freeze_vision_tower."""
    checkpointing: bool = True
    """model.gradient_checkpointing (every layer)."""
    offload: bool = False
    """model.activation_offload: the checkpointed layers' inputs wait in pinned host memory."""
    weights_bytes: int = 4
    """Master weights' bytes per element (4: fp32, as the trainer keeps them)."""
    compute_bytes: int = 2
    """Activations' bytes per element (2: bf16 autocast on a GPU; 4 on the CPU)."""
    kv_bytes: int = 2
    """Bytes per cached key/value element: the compute dtype's (kv_generation.py stores them so)."""
    frozen_bytes: int = 2
    """Frozen Linear weights under LoRA (model.frozen_weights_dtype=auto: the compute dtype)."""
    logprob_chunk: int = 1024
    """model.logprob_chunk: positions through the LM head at a time."""
    gpus: int = 1
    """Training ranks (FSDP2 above 1)."""
    in_process: bool = True
    """Rollouts generate with this process's model (rollout.backend=hf)."""
    push_on_gpu: bool = False
    """rollout.weight_sync=stream over rollout.stream_backend=nccl: the push sends from the GPU, so
    the tensor being sent stays there while the next is gathered (agent.model.shards.full_tensors
    runs one ahead on a GPU); over gloo the one being sent is in host memory."""
    attention_scores: bool = False
    """Attention materialises its (heads, T, T) scores: the CPU's SDPA does, a GPU's flash / cuDNN
    kernels do not. One layer's at a time (tests/training/test_plan.py measures it)."""


def training_of(cfg: Any, gpus: int | None = None, device: str = "cuda") -> Training:
    """What of `cfg` decides the update's memory on `gpus` GPUs (`device="cpu"`: a CPU run)."""
    on_gpu = device != "cpu"
    return Training(lora_rank=cfg.model.lora_rank, optimizer=cfg.train.optimizer,
                    freeze_vision=cfg.model.freeze_vision_tower, checkpointing=cfg.model.gradient_checkpointing,
                    offload=cfg.model.gradient_checkpointing and cfg.model.activation_offload and on_gpu,
                    compute_bytes=2 if on_gpu else 4, kv_bytes=2 if on_gpu else 4,
                    frozen_bytes=2 if on_gpu and cfg.model.frozen_weights_dtype == "auto" else 4,
                    logprob_chunk=cfg.model.logprob_chunk or 10 ** 9,
                    gpus=gpus or cfg.train.nproc_per_node, in_process=cfg.rollout.backend == "hf",
                    push_on_gpu=(on_gpu and cfg.rollout.weight_sync == "stream"
                                 and cfg.rollout.stream_backend == "nccl"),
                    attention_scores=not on_gpu)


def _resident(shape: ModelShape, t: Training) -> dict[str, float]:
    """Bytes that stay on a GPU through the whole step: weights and the optimizer's state."""
    n, trained = t.gpus, _trained_params(shape, t)
    if t.lora_rank:  # every frozen Linear in the compute dtype (lora.cast_frozen_linears), the rest and the adapters fp32
        frozen = shape.counts.frozen_linear
        weights = t.frozen_bytes * frozen + t.weights_bytes * (shape.params - frozen)
        weights += 4 * trained
    else:
        weights = t.weights_bytes * shape.params
    if t.optimizer == "adamw":
        state = 8 * trained
    elif t.optimizer == "adafactor":  # factored second moments of the trained matrices
        state = 4 * shape.counts.factored * (trained / shape.params)
    else:  # "none": a forward and backward only (the benchmarks' fwd+bwd)
        state = 0
    parts = {"weights": weights / n, "optimizer state": state / n}
    if n > 1 and t.in_process:  # every rank keeps the whole model to generate with
        parts["full copy for rollouts"] = weights
    return parts


def _gathered(shape: ModelShape, t: Training, backward: bool) -> dict[str, float]:
    """FSDP2's transient whole tensors (benchmarks/memory_table.py's formula): the root unit and
    two layers gathered in bf16 through a forward; in a backward also the root's unsharded bf16
    and fp32 gradients before their reduce-scatter."""
    if t.gpus == 1:
        return {}
    c = shape.counts
    parts = {"gathered units (bf16)": 2 * (c.root + 2 * c.largest_unit)}
    if backward and not t.lora_rank:
        parts["root's unreduced gradients"] = 6 * c.root
    return parts


def _trained_params(shape: ModelShape, t: Training) -> int:
    if t.lora_rank:
        return t.lora_rank * shape.counts.lora_per_rank
    return shape.params - (shape.counts.vision if t.freeze_vision else 0)


def activation_bytes(shape: ModelShape, w: Workload, t: Training, backward: bool = True) -> dict[str, float]:
    """One micro-batch's activations at their peak, by part. Without `backward`: a forward under
    no_grad (one layer's working set, no kept inputs)."""
    k = ACTIVATION_COEFFICIENTS
    scale = t.compute_bytes / 2  # the coefficients are for bf16
    tokens, patches = w.tokens * w.rows, w.patches * w.rows
    working = k["text_working"] * tokens * (shape.hidden + shape.intermediate) * scale
    logits = min(t.logprob_chunk, w.trained * w.rows) * shape.vocab * (10 if backward else 6)
    # 2 bytes per score: fitted to the tiny models' CPU runs (tests/training/test_plan.py)
    scores = {"attention scores": 2 * shape.heads * w.tokens ** 2 * w.rows} if t.attention_scores else {}
    if not backward:  # one decoder layer's or one vision block's forward at a time: the MLP's three
        # (T, intermediate) tensors in the compute dtype, a few (T, hidden) in fp32 (the residual stream)
        text = tokens * (3 * t.compute_bytes * shape.intermediate + 16 * shape.hidden)
        vision = patches * (3 * t.compute_bytes * shape.vision_intermediate + 16 * shape.vision_embed)
        layer = {"one decoder layer's forward": text} if text >= vision else {"one vision block's forward": vision}
        return {**layer, "LM head chunk": logits, **scores}
    if t.checkpointing:  # (with t.offload they are in host memory: Phase.host)
        parts = {} if t.offload else {"kept layer inputs": kept_layer_inputs(shape, w, t)}
    else:  # every layer keeps what its backward reads: ~6 (T, hidden) and 4 (T, intermediate) tensors
        # (7B at 41.7k tokens: ~8 GB a layer, as benchmarks/RESULTS.md measured)
        parts = {"kept layer activations": 2 * scale * tokens * (6 * shape.hidden + 4 * shape.intermediate) * shape.layers}
    parts.update({"text layer working set": working, "LM head chunk": logits, **scores})
    # Under LoRA the tower is frozen and records no graph (lora.drop_frozen_vision_input_grads):
    # nothing of it is alive at the backward. The one LoRA run on an H100 peaked above what the
    # terms here explain; that excess, per token, is carried as a fitted margin under its own name.
    if t.lora_rank:
        parts["LoRA: unexplained margin (fitted to the H100 run)"] = (
            k["lora_unexplained"] * tokens * (shape.hidden + shape.intermediate) * scale)
    elif not t.freeze_vision:
        parts["vision tower"] = k[shape.model_type] * patches * shape.vision_depth * shape.vision_embed * scale
    return parts


def frozen_tower_forward(shape: ModelShape, w: Workload, t: Training) -> dict[str, float]:
    """A frozen tower (model.freeze_vision_tower, or LoRA) runs without gradients at the start of
    each micro-batch's forward, while the earlier micro-batches' gradients are alive: one vision
    block's working set (its MLP's three (patches, intermediate) tensors in the compute dtype, a
    few (patches, embed) in fp32) and the tower's output embeddings (fp32)."""
    patches = w.patches * w.rows
    block = patches * (3 * t.compute_bytes * shape.vision_intermediate + 16 * shape.vision_embed)
    embeddings = 4 * patches // shape.merge ** 2 * shape.hidden
    return {"one vision block's forward": block, "the tower's output": embeddings}


def kept_layer_inputs(shape: ModelShape, w: Workload, t: Training) -> float:
    """What activation checkpointing keeps for the recompute: each decoder layer's input, in the
    residual stream's dtype, which is the master weights' (the embeddings' output; under bf16
    autocast the residual adds stay fp32 with fp32 weights): fp32 in the trainer, bf16 only with
    bf16 weights (the benchmarks' fwd+bwd runs)."""
    return t.weights_bytes * w.tokens * w.rows * shape.hidden * shape.layers


@dataclass
class Phase:
    name: str
    parts: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)
    """What the phase keeps in the host's memory instead (pinned), by part."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def phases(shape: ModelShape, w: Workload, t: Training) -> list[Phase]:
    """Each phase of one step with its parts, in bytes per GPU."""
    resident = _resident(shape, t)
    grad_bytes = 4 if t.lora_rank else t.weights_bytes  # a gradient has its parameter's dtype
    grads = {"gradients": grad_bytes * _trained_params(shape, t) / t.gpus}
    out = []
    if w.generation_rows:
        per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * t.kv_bytes
        cached = per_token * w.generation_rows * w.generation_context
        slab = per_token * (w.generation_batch or w.generation_rows) * (w.generation_context + w.max_new_tokens)
        prefill = activation_bytes(shape, Workload(tokens=w.prefill_tokens, patches=w.prefill_patches, trained=1), t,
                                   backward=False)
        out.append(Phase("generation", {**resident, "KV cache (episodes' copies)": cached,
                                        "KV cache (the step's slab)": slab, "prefill": sum(prefill.values())}))
    # the micro-batch's pixels, fp32 (patches x channels x temporal patch x patch^2): 0.7 GiB at 15 1080p screenshots
    inputs = {"pixel inputs": 4 * w.rows * w.patches * 3 * 2 * shape.patch ** 2}
    out.append(Phase("old log-probs", {**resident, **_gathered(shape, t, False), **inputs,
                                       **activation_bytes(shape, w, t, backward=False)}))
    host = {"kept layer inputs (pinned)": kept_layer_inputs(shape, w, t)} if t.checkpointing and t.offload else {}
    out.append(Phase("update", {**resident, **grads, **_gathered(shape, t, True), **inputs,
                                **activation_bytes(shape, w, t)}, host))
    if (t.freeze_vision or t.lora_rank) and w.patches:
        out.append(Phase("update, frozen tower's forward", {**resident, **grads, **_gathered(shape, t, False),
                                                            **inputs, **frozen_tower_forward(shape, w, t)}))
    if not t.in_process:
        largest = shape.largest_text_linear if t.lora_rank else shape.largest_param
        # agent.model.shards.full_tensors: over several ranks gathered in fp32, then cast to bf16; the
        # tensor being sent beside it when it is sent from the GPU (the pass runs one ahead there)
        gathered = {"one tensor gathered": 2 * largest if t.gpus == 1 else 6 * largest}
        if t.push_on_gpu:
            gathered["the tensor being sent (NCCL)"] = 2 * largest
        out.append(Phase("weight push", {**resident, **gathered}))
    return out


def evaluation_phase(cfg: Any, shape: ModelShape, screen: tuple[int, int] | None = None,
                     device: str = "cuda") -> Phase:
    """A standalone evaluation on one GPU (`build.engine`): the weights once, in the compute dtype
    (HFPolicy weights_dtype="compute"), the episodes' KV caches (one live episode per environment)
    and one prefill; the response cap is the evaluation's (`eval.max_new_tokens`, else the model's)."""
    compute = 2 if device != "cpu" else 4
    t = Training(optimizer="none", weights_bytes=compute, compute_bytes=compute, kv_bytes=compute,
                 attention_scores=device == "cpu")
    w = workload(cfg, shape, screen, gpus=1)
    rows = max(1, cfg.env.workers * cfg.env.envs_per_worker)
    cap = cfg.eval.max_new_tokens or cfg.model.max_new_tokens
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * t.kv_bytes
    prefill = activation_bytes(shape, Workload(tokens=w.prefill_tokens or w.tokens, patches=w.prefill_patches or w.patches,
                                               trained=1), t, backward=False)
    return Phase("evaluation", {"weights": compute * shape.params,
                                "KV cache (episodes' copies)": per_token * rows * w.tokens,
                                "KV cache (the step's slab)": per_token * rows * (w.tokens + cap),
                                "prefill": sum(prefill.values())})


def usable(gpu_memory: float) -> float:
    """What of a card's memory the planner lets tensors have."""
    return gpu_memory * (1 - FRAGMENTATION) - RESERVE_BYTES


# ---- the levers -----------------------------------------------------------------------------------

Candidates = Callable[[Any], list[list[str]]]
"""A lever's function: a config -> the override sets that apply the lever to it, gentlest first; []
where it is applied already."""


@dataclass(frozen=True)
class Lever:
    name: str
    """The overrides it stands for, as a reader would write them (`env.workers=N`)."""
    cost: str
    """What it costs, in speed or in fidelity to ARPO's setting."""
    candidates: Candidates


LEVERS: list[Lever] = []
"""In the order registered, which is the order of cost: free first, then speed, then fidelity."""


def register_lever(name: str, cost: str) -> Callable[[Candidates], Candidates]:
    """Registers the decorated function as the lever `name`, tried after those registered before it."""
    def register(candidates: Candidates) -> Candidates:
        if any(lever.name == name for lever in LEVERS):
            raise ValueError(f"a lever {name!r} is registered already")
        LEVERS.append(Lever(name, cost, candidates))
        return candidates
    return register


@register_lever("train.micro_batch_size=1 train.token_budget=0", "none: gradient-exact, more micro-batches")
def one_trajectory_per_micro_batch(cfg: Any) -> list[list[str]]:
    if cfg.train.micro_batch_size == 1 and not cfg.train.token_budget:
        return []
    return [["train.micro_batch_size=1", "train.token_budget=0"]]


@register_lever("model.gradient_checkpointing=true", "speed: the forward runs twice (~30% slower update); exact")
def gradient_checkpointing(cfg: Any) -> list[list[str]]:
    return [] if cfg.model.gradient_checkpointing else [["model.gradient_checkpointing=true"]]


@register_lever("model.activation_offload=true",
                "speed: each layer's kept input is copied to pinned host memory and back over PCIe (estimated "
                "~0.7 s of a ~13 s 7B update at 15 screenshots; not yet timed), host memory as the plan says; exact")
def activation_offload(cfg: Any) -> list[list[str]]:
    if cfg.model.activation_offload:
        return []
    return [["model.gradient_checkpointing=true", "model.activation_offload=true"]]


@register_lever("env.workers=N",
                "speed: fewer episodes live at once (each keeps its KV cache); same episodes, same tokens")
def fewer_workers(cfg: Any) -> list[list[str]]:
    if cfg.rollout.backend != "hf":
        return []
    current = min(cfg.env.workers, cfg.train.tasks_per_batch * cfg.rollout.group_size)
    sizes = sorted({n for n in (current // 2, current // 4, 2, 1) if 1 <= n < current}, reverse=True)
    return [[f"env.workers={n}"] for n in sizes]


@register_lever("train.optimizer=adafactor", "fidelity: factored second moments instead of AdamW's")
def adafactor(cfg: Any) -> list[list[str]]:
    return [] if cfg.train.optimizer == "adafactor" or cfg.model.lora_rank else [["train.optimizer=adafactor"]]


@register_lever("model.freeze_vision_tower=true", "fidelity: the vision tower is not trained (ARPO trains it); faster")
def freeze_vision_tower(cfg: Any) -> list[list[str]]:
    return [] if cfg.model.freeze_vision_tower or cfg.model.lora_rank else [["model.freeze_vision_tower=true"]]


@register_lever("model.lora_rank=16", "fidelity: LoRA adapters on the language model instead of a full fine-tune")
def lora(cfg: Any) -> list[list[str]]:
    if cfg.model.lora_rank:
        return []
    return [["model.lora_rank=16", "train.optimizer=adamw", "model.freeze_vision_tower=false"]]


@register_lever("model.history_images=N", "fidelity: fewer screenshots in the context (ARPO keeps 15)")
def fewer_screenshots(cfg: Any) -> list[list[str]]:
    return [[f"model.history_images={n}"] for n in (10, 8, 5, 3, 2, 1) if n < cfg.model.history_images]


@dataclass
class Plan:
    """The planner's answer for one config on one kind of GPU."""

    model: str
    gpu_memory: float
    gpus: int
    workload: Workload
    phases: list[Phase]
    overrides: list[str] = field(default_factory=list)
    """Overrides the config was planned with (the levers applied)."""
    levers: list[tuple[Lever, list[str], float]] = field(default_factory=list)
    """Levers tried in order: (lever, the overrides it adds, the peak after it)."""
    evaluation: Phase | None = None
    """A standalone evaluation of the config's model (`./workbench eval`, evaluation.ipynb) on one
    GPU, generating in process: not part of a training step, so not of `peak`."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= usable(self.gpu_memory)

    @property
    def fits_with_levers(self) -> bool:
        """Whether the config with every lever of `levers` applied fits."""
        return self.fits or bool(self.levers) and self.levers[-1][2] <= usable(self.gpu_memory)

    def table(self) -> str:
        rows = ["| phase | GiB per GPU | largest parts |", "|---|---|---|"]
        for p in self.phases:
            big = sorted(p.parts.items(), key=lambda kv: -kv[1])[:3]
            rows.append(f"| {p.name} | {p.total / GIB:.1f} | "
                        + ", ".join(f"{k} {v / GIB:.1f}" for k, v in big) + " |")
        return "\n".join(rows)

    def report(self) -> str:
        w = self.workload
        lines = [f"{self.model} on {self.gpus} GPU(s) of {self.gpu_memory / GIB:.1f} GiB "
                 f"(usable {usable(self.gpu_memory) / GIB:.1f} GiB: {RESERVE_BYTES / GIB:.1f} GiB reserve, "
                 f"{FRAGMENTATION:.0%} fragmentation)",
                 f"trajectory: {w.tokens:,} tokens, {w.patches:,} patches, {w.trained:,} trained; "
                 f"{w.rows} per micro-batch; generation rows: {w.generation_rows or 'on the servers'}",
                 "", self.table(), "",
                 f"peak: {self.peak.name}, {self.peak.total / GIB:.1f} GiB: "
                 + ("fits" if self.fits else "does NOT fit")]
        host = max((sum(p.host.values()) for p in self.phases), default=0)
        if host:
            lines.append(f"host memory beside it: {host / GIB:.1f} GiB pinned (model.activation_offload)")
        if self.evaluation is not None:
            e = self.evaluation
            big = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(e.parts.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"evaluation (`./workbench eval`, in process, one copy of the weights in the compute dtype): "
                         f"{e.total / GIB:.1f} GiB ({big}): "
                         + ("fits" if e.total <= usable(self.gpu_memory) else "does NOT fit"))
        if self.levers:
            lines += ["", "levers, cheapest first, each on top of the ones above:"]
            for lever, added, peak in self.levers:
                lines.append(f"- {' '.join(added)}: peak {peak / GIB:.1f} GiB ({lever.cost})")
        if not self.fits:
            lines += ["", "with them it fits (`--write FILE` writes that config)" if self.fits_with_levers else
                      "it does not fit even with every lever the planner knows: a card with more memory, more "
                      "GPUs (--gpus), or rollouts on a server (rollout.backend=server)"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu_memory_gib": self.gpu_memory / GIB, "gpus": self.gpus,
                "workload": dataclasses.asdict(self.workload), "fits": self.fits, "overrides": self.overrides,
                "phases": {p.name: {"total_gib": p.total / GIB, "parts_gib": {k: v / GIB for k, v in p.parts.items()},
                                    **({"host_gib": {k: v / GIB for k, v in p.host.items()}} if p.host else {})}
                           for p in self.phases},
                "levers": [{"overrides": added, "cost": lever.cost, "peak_gib": peak / GIB}
                           for lever, added, peak in self.levers],
                **({"evaluation": {"total_gib": self.evaluation.total / GIB,
                                   "parts_gib": {k: v / GIB for k, v in self.evaluation.parts.items()}}}
                   if self.evaluation is not None else {})}


def plan(cfg: Any, gpu_memory: float, gpus: int | None = None, screen: tuple[int, int] | None = None,
         shape: ModelShape | None = None, device: str = "cuda") -> Plan:
    """The phases of `cfg` on `gpus` GPUs of `gpu_memory` bytes; if they do not fit, the levers
    (LEVERS, in order) applied one after another until they do, each with the peak after it."""
    from arpo_lib.run.config import config_from_dict

    shape = shape or cached_shape(cfg.model.path)
    gpus = gpus or cfg.train.nproc_per_node

    def evaluate(c: Any) -> list[Phase]:
        return phases(shape, workload(c, shape, screen, gpus), training_of(c, gpus, device))

    first = Plan(cfg.model.path, gpu_memory, gpus, workload(cfg, shape, screen, gpus), evaluate(cfg),
                 evaluation=evaluation_phase(cfg, shape, screen, device))
    if first.fits:
        return first
    # Greedy, cheapest first: each round takes the first lever (in LEVERS' order) whose gentlest
    # setting lowers the peak, then looks again from the cheapest (another phase may now hold it).
    current, applied, tried = cfg, [], []
    peak = first.peak.total
    while peak > usable(gpu_memory):
        for lever in LEVERS:
            for candidate in lever.candidates(current):
                trial = config_from_dict(_with_overrides(current, candidate))
                after = max(p.total for p in evaluate(trial))
                if after < peak * 0.995:
                    break
            else:
                continue
            tried.append((lever, candidate, after))
            current, applied, peak = trial, applied + candidate, after
            break
        else:  # no lever lowers it further
            break
    if peak <= usable(gpu_memory):  # a lever that a later, stronger one made unneeded goes again,
        for entry in reversed(list(tried)):  # the costliest first
            rest = [e for e in tried if e is not entry]
            trial = config_from_dict(_with_overrides(cfg, [o for _, added, _ in rest for o in added]))
            if max(p.total for p in evaluate(trial)) <= usable(gpu_memory):
                tried = rest
        current = cfg
        for i, (lever, added, _) in enumerate(tried):  # each peak on top of the ones kept above it
            current = config_from_dict(_with_overrides(current, added))
            tried[i] = (lever, added, max(p.total for p in evaluate(current)))
    first.levers = tried
    first.overrides = _net(cfg, [o for _, added, _ in tried for o in added])
    return first


def _net(cfg: Any, overrides: list[str]) -> list[str]:
    """`overrides` as their net effect on `cfg`: each key's last value, the ones that change it."""
    from arpo_lib.run.config import flat_dict

    before = flat_dict(cfg.to_dict())
    last = dict(item.split("=", 1) for item in overrides)
    after = flat_dict(_with_overrides(cfg, overrides))
    return [f"{key}={value}" for key, value in last.items() if after[key] != before[key]]


def fitted(cfg: Any, p: Plan) -> Any:
    """`cfg` with the plan's levers applied."""
    from arpo_lib.run.config import config_from_dict

    return config_from_dict(_with_overrides(cfg, p.overrides))


def _with_overrides(cfg: Any, overrides: list[str]) -> dict[str, Any]:
    from arpo_lib.run.config import flat_dict, parse_overrides

    data = cfg.to_dict()
    for key, value in flat_dict(parse_overrides(overrides)).items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return data


def write_config(cfg: Any, p: Plan, path: str | Path, screen: tuple[int, int] | None = None,
                 shape: ModelShape | None = None, device: str = "cuda") -> Path:
    """The fitted config as YAML, the planner's table and the levers in its header comment."""
    import yaml

    after = plan(fitted(cfg, p), p.gpu_memory, p.gpus, screen, shape, device)
    header = ["Written by `./workbench plan`: " + (" ".join(p.overrides) or "no change"),
              *after.report().splitlines()]
    text = "".join(f"# {line}".rstrip() + "\n" for line in header)
    path = Path(path)
    path.write_text(text + yaml.safe_dump(fitted(cfg, p).to_dict(), sort_keys=False))
    return path


def parse_memory(text: str) -> float:
    """A GPU's memory in bytes: a card's name (`A100-40GB`, `L4`, `H100-80GB`: what the card
    reports to torch, `training.cards`), or a number read as written: `40GB` (10^9 bytes), `40GiB`,
    or a bare `80` (GiB)."""
    import re

    from arpo_lib.training.cards import CARDS, find

    card = find(text)
    if card is not None:
        return card.bytes
    match = re.fullmatch(r"\s*([\d.]+)\s*(gib|gb|g)?\s*", text.lower())
    if not match:
        raise ValueError(f"GPU memory {text!r}: a card ({', '.join(CARDS)}) or a size like 40GB, 39.6GiB or 80")
    number, unit = float(match.group(1)), match.group(2)
    return number * (1e9 if unit == "gb" else GIB)


class DoesNotFit(RuntimeError):
    """A run's plan says it does not fit the GPU it is about to run on; the message is the plan."""


def require_fit(cfg: Any, gpu_memory: float | None = None) -> Plan | None:
    """For a notebook or a trainer about to start on a GPU: the plan of `cfg` on this machine's
    first GPU (or `gpu_memory` bytes), raising `DoesNotFit` with the planner's table and levers
    when it does not fit; None where there is no GPU to plan for."""
    if gpu_memory is None:
        import torch

        if not torch.cuda.is_available() or cfg.model.device == "cpu":
            return None
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    result = plan(cfg, gpu_memory, cfg.train.nproc_per_node)
    if not result.fits:
        raise DoesNotFit(f"{result.report()}\n\n(`./workbench plan --config ... --write FILE` writes the config "
                         "with these levers applied)")
    return result


def save_plan(p: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.to_dict(), indent=1) + "\n")
