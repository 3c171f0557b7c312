"""The measured path: what one training step holds in memory, without the model's weights and
without a GPU, measured through the training code itself (the planner, `training/plan.py`, is the
model this checks).

Torch's fake process group (`fake_ranks`: this process is rank 0 of N, the collectives move
nothing), every tensor a FakeTensor (`fake_tensors`: shapes and dtypes, no storage), and torch's
FSDP2 memory tracker counting what exists, by kind, through one training step (`measure_step`).
`measure`: a config's planned trajectory through it (`./workbench plan --measure`);
`benchmarks/memory_measured.py` measures with it too. No weights are read: a model's config.json
and, for `measure`, a tokenizer.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arpo_lib.training.workload import RESPONSE_TOKENS, cache_dir, cached_shape, default_screen, model_config

GIB = 2 ** 30
PHASES = ("start-up", "old log-probs", "update", "weight push")


def screenshot(seed: int, size: tuple[int, int] = (320, 420)) -> Any:
    """Random pixels: a stand-in screenshot (seeded, so runs compare)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def synthetic_trajectory(policy: Any, n_screenshots: int, size: tuple[int, int], response_tokens: int = 48,
                         seed: int = 0):
    """A trajectory segment built through the real chat template and image processor, with random
    ordinary-token responses standing in for sampled ones (all trained on)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    conv = policy.new_conversation("Open the settings and turn on dark mode")
    ordinary = min(policy.tokenizer.convert_tokens_to_ids("<|endoftext|>"), policy.model.config.get_text_config().vocab_size)
    for step in range(n_screenshots):
        conv.add_observation(screenshot(seed * 1000 + step, size))
        ids = rng.integers(0, ordinary, response_tokens).tolist() + [conv.eos_id]
        conv.add_response("", ids, [0.0] * len(ids))
    return conv.current


@contextlib.contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """Torch's fake process group: this process is rank 0 of `world_size`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """FakeTensorMode in which small integer tensors made `constant` keep their values through
    the operations on them (token ids, grid sizes, window boundaries: the model reads them with
    `.tolist()`), so the model's data-dependent steps run while every large tensor stays fake."""
    import torch._subclasses.fake_tensor as ft

    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = 10 ** 7
    try:
        with ft.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit


class ScalarsReadAsOne(TorchDispatchMode):
    """Inside FakeTensorMode, a fake tensor's value read on the host (`float(t)`, `.tolist()`) is 1:
    the optimizer's norms (ShardedAdafactor reads each parameter's) scale the update, they do not
    change what is allocated. Only around the optimizer's step; a data-dependent *shape* still fails."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if (func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor)
                and args[0].constant is None):
            return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def training_forward(suppress_ids: Any) -> Any:
    """`HFPolicy.forward_logprobs` as the policy runs it (bf16 autocast, log-probs in chunks of 1024)."""
    from arpo_lib.agent.hf_policy import HFPolicy

    stub = SimpleNamespace(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                           suppress_ids=suppress_ids, logprob_chunk=1024)
    return lambda net, b, targets, temperature: HFPolicy.forward_logprobs(stub, net, b, targets, temperature)


def with_index_tensors(batch: dict[str, Any], shell: Any) -> dict[str, Any]:
    """`batch` plus the index tensors the model would derive from it (3D rope positions, vision
    windows), computed with the model's own functions (`shell`: the model, on the meta device is
    enough) outside FakeTensorMode, where their data-dependent shapes can be evaluated."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    grid = batch["image_grid_thw"]
    batch["position_ids"] = shell.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=grid,
        attention_mask=batch["attention_mask"])[0]
    vc = shell.config.vision_config
    batch["cu_seqlens"] = get_vision_cu_seqlens(grid)
    if getattr(vc, "window_size", None):  # Qwen2.5-VL's windowed vision attention
        batch["window_index"], batch["cu_window_seqlens"] = get_vision_window_index(
            grid, spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size)
    return batch


def fake_batch(mode: Any, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs, target mask) inside `mode`: the pixels fake, the small integer tensors constants."""
    conv = mode.fake_tensor_converter
    fake = {k: (mode.from_tensor(v) if k == "pixel_values" else conv.from_real_tensor(mode, v, make_constant=True))
            for k, v in batch.items()}
    return fake, fake.pop("loss_mask").bool()


def tracker_peak(tracker: Any) -> dict[str, float]:
    """A memory tracker's peak on the CPU device (where the fake tensors live), by kind, in bytes."""
    snapshot = tracker.get_tracker_snapshot("peak")
    by_kind = next(iter(snapshot.values()))
    return {str(getattr(k, "value", k)): float(v) for k, v in by_kind.items()}


def measure_step(model: Any, batch: dict[str, torch.Tensor], world_size: int, optimizer: str = "adamw",
                 freeze_vision: bool = False) -> dict[str, Any]:
    """Rank 0's peak bytes, by kind, in each phase of one training step at `world_size` ranks
    (PHASES). `model`: on the meta device (it is materialised as fakes here); `batch`: one
    micro-batch with its index tensors (`with_index_tensors`) and `suppress_ids`.
    Phases: start-up (the full fp32 model and this rank's shards), old log-probs (the forward
    without gradients), update (forward, backward and the optimizer step, the optimizer's state
    already there, as from the second step on), weight push (every trainable parameter gathered
    whole, cast to bf16, one at a time)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from arpo_lib.agent.hf_policy import enable_activation_checkpointing, set_vision_tower_trainable
    from arpo_lib.agent.model.vision_attention import use_batched_vision_attention
    from arpo_lib.agent.model.shards import full_tensors
    from arpo_lib.training import distributed as dist_
    from arpo_lib.training.optim import make_optimizer

    batch = dict(batch)
    suppress = batch.pop("suppress_ids")
    use_batched_vision_attention(model)
    enable_activation_checkpointing(model)
    if freeze_vision:
        set_vision_tower_trainable(model, False)
    forward = training_forward(suppress)
    phases: dict[str, dict[str, float]] = {}
    with fake_ranks(world_size):
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: it reads a tensor's values
        with fake_tensors() as mode:
            with MemTracker() as startup:
                model.to_empty(device="cpu")  # the full fp32 model every rank keeps today
                model.tie_weights()  # to_empty unties them (2B's LM head is its input embedding)
                net = dist_.shard_for_training(model, forward, compute_dtype=torch.bfloat16, mesh=mesh)
            phases["start-up"] = tracker_peak(startup)
            full_copy = float(sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())))
            params = [p for p in net.parameters() if p.requires_grad]
            if optimizer == "adamw":  # make_optimizer fuses it on CUDA (no temporaries); fused under
                # FakeTensorMode counts its functional outputs as new memory: one parameter at a time here
                opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=False)
            else:
                opt = make_optimizer(optimizer, params, lr=1e-6, weight_decay=0.0)
            for p in params:  # the optimizer's state as after the first step: the steady state is measured
                p.grad = torch.zeros_like(p)
            with ScalarsReadAsOne():
                opt.step()
            opt.zero_grad(set_to_none=True)
            fake, targets = fake_batch(mode, batch)

            def tracked() -> Any:
                tracker = FSDPMemTracker(net, opt)  # the full copy is added to these, not tracked
                tracker.track_inputs((fake, targets))
                return tracker

            with tracked() as t, torch.no_grad():
                net(dict(fake), targets, 1.0)
            phases["old log-probs"] = tracker_peak(t)
            net.train()
            with tracked() as t:
                net(dict(fake), targets, 1.0).sum().backward()
                with ScalarsReadAsOne():
                    opt.step()
                opt.zero_grad(set_to_none=True)
            phases["update"] = tracker_peak(t)
            net.eval()
            trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
            with tracked() as t:
                for _, whole in full_tensors(trainable, torch.device("cpu"), [torch.bfloat16] * len(trainable)):
                    del whole
            phases["weight push"] = tracker_peak(t)
            largest = max(p.numel() for _, p in trainable) * 2
            shards = float(sum(p.to_local().numel() * p.element_size() for p in net.parameters()))
    return {"world_size": world_size, "optimizer": optimizer, "freeze_vision": freeze_vision,
            "tokens": int(batch["input_ids"].shape[1]), "patches": int(batch["pixel_values"].shape[0]),
            "full_copy_bytes": full_copy, "shard_bytes": shards, "largest_bf16_param_bytes": float(largest),
            "phases": phases}


def measure_fwd_bwd(model: Any, batch: dict[str, torch.Tensor]) -> float:
    """Peak bytes of one forward+backward of `model` (meta device) on one device, with bf16
    weights, activation checkpointing and the training forward, counted by torch's memory tracker
    over fake tensors: what `torch.cuda.max_memory_allocated` reads on a GPU (~9% above it on the 7B)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from arpo_lib.agent.hf_policy import enable_activation_checkpointing
    from arpo_lib.agent.model.vision_attention import use_batched_vision_attention

    batch = dict(batch)
    forward = training_forward(batch.pop("suppress_ids"))
    model = model.to(torch.bfloat16)
    use_batched_vision_attention(model)
    enable_activation_checkpointing(model)
    model.train()
    with fake_tensors() as mode, MemTracker() as tracker:
        model.to_empty(device="cpu")
        model.tie_weights()
        fake, targets = fake_batch(mode, batch)
        logprobs = forward(model, fake, targets, 1.0)
        (-logprobs.mean()).backward()
    return tracker_peak(tracker)["Total"]


def measure(cfg: Any, gpus: int = 1, screen: tuple[int, int] | None = None, tokenizer_dir: str | None = None,
            progress: Any = None) -> dict[str, float]:
    """The update's phases of `cfg` MEASURED without a GPU (FakeTensorMode, torch's fake process
    group at `gpus` ranks, FSDP2's memory tracker): the trajectory the planner assumes, built by
    the real chat template and image processor (of `tokenizer_dir`, default the model's own
    directory, else the local tiny model of its architecture), through the training code. Bytes
    per phase (old log-probs, update, weight push). Cached in `cache_dir()` by its inputs: a 7B
    takes ~1.5 min on a CPU, a repeat none. Full fine-tunes only (the measured step does not
    apply LoRA)."""
    import hashlib

    from transformers import AutoModelForImageTextToText

    from arpo_lib.agent.hf_policy import HFPolicy, pad_segments

    if cfg.model.lora_rank:
        raise ValueError("the measured path does not apply LoRA (model.lora_rank): the arithmetic stands alone there")
    config = model_config(cfg.model.path)
    shape = cached_shape(cfg.model.path)
    images = min(cfg.model.history_images, cfg.env.max_steps)
    response = min(cfg.model.max_new_tokens, RESPONSE_TOKENS)
    screen = screen or default_screen(cfg)
    key_text = json.dumps([config.to_json_string(use_diff=False), images, screen, response, gpus,
                           cfg.train.optimizer, cfg.model.freeze_vision_tower, torch.__version__])
    file = cache_dir() / f"measured-{hashlib.sha256(key_text.encode()).hexdigest()[:16]}.json"
    if file.is_file():
        return json.loads(file.read_text())
    if tokenizer_dir is None:
        own = Path(cfg.model.path)
        variant = "qwen25vl" if shape.model_type == "qwen2_5_vl" else "qwen2vl"
        tokenizer_dir = str(own if (own / "tokenizer_config.json").is_file() and shape.params < 10 ** 8
                            else Path(__file__).resolve().parents[2] / "models" / f"tiny-uitars-{variant}")
    if progress:
        progress(f"measuring {cfg.model.path} on fake tensors ({images} screenshots, {gpus} rank(s)) ...")
    policy = HFPolicy(tokenizer_dir, device="cpu")
    ip = policy.processor.image_processor  # UI-TARS's limits: a 1080p screenshot is not downscaled
    ip.size = type(ip.size)(shortest_edge=3136, longest_edge=16384 * 28 * 28)
    policy.resize = (28, 3136, 16384 * 28 * 28)
    # the special tokens' ids of the tokenizer that makes the trajectory (the tiny model's are not the real one's)
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(config, name, getattr(policy.model.config, name))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    batch = pad_segments([synthetic_trajectory(policy, images, screen, response)], policy.pad_id, side="right")
    batch = with_index_tensors(batch, model)
    batch["suppress_ids"] = policy.suppress_ids
    result = measure_step(model, batch, gpus, cfg.train.optimizer, cfg.model.freeze_vision_tower)
    out = {name: result["phases"][name]["Total"] for name in ("old log-probs", "update", "weight push")}
    out["tokens"], out["patches"] = result["tokens"], result["patches"]
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(out) + "\n")
    return out
