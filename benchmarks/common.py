"""Shared by the benchmarks: model shapes, synthetic multi-screenshot trajectories, FLOP counts,
timing and the results file.

Shapes: `tiny` is the locally built test model (CPU, seconds). `2b` and `7b` are UI-TARS-2B
(Qwen2-VL-2B) and UI-TARS-1.5-7B (Qwen2.5-VL-7B) with random weights: their published config
values, the tiny model's tokenizer for the special-token ids. Nothing is downloaded.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from arpo_lib.training.memory_model import screenshot, synthetic_trajectory  # noqa: F401  (the benchmarks' and tests' import)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

# Published config values (config.json of Qwen/Qwen2-VL-2B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct).
REAL_SHAPES: dict[str, dict[str, Any]] = {
    "2b": dict(variant="qwen2vl", vocab=151936, spec=dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vision_depth=32, vision_embed_dim=1280, vision_num_heads=16,
        vision_intermediate_size=5120)),
    "7b": dict(variant="qwen25vl", vocab=152064, fullatt=[7, 15, 23, 31], spec=dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vision_depth=32, vision_embed_dim=1280, vision_num_heads=16,
        vision_intermediate_size=3420)),
    "32b": dict(variant="qwen25vl", vocab=152064, fullatt=[7, 15, 23, 31], spec=dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        intermediate_size=27648, vision_depth=32, vision_embed_dim=1280, vision_num_heads=16,
        vision_intermediate_size=3456)),
}
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by GPU family (no sparsity), for MFU."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def tiny_model_dir(variant: str) -> Path:
    path = ROOT / "models" / f"tiny-uitars-{variant}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is missing: run ./workbench setup (or ./workbench build-tiny-model)")
    return path


def real_config(shape: str, text_layers: int | None = None, vision_layers: int | None = None) -> Any:
    """The model config of a real shape (2b, 7b, 32b): the published widths and depths, the
    tokenizer of the local tiny model of the same architecture. `text_layers` / `vision_layers`
    shrink the depth (the real widths, fewer layers: a CPU check)."""
    from transformers import AutoProcessor

    from arpo_lib.training.tiny_model import TinyModelSpec, _build_config

    real = REAL_SHAPES[shape]
    tokenizer = AutoProcessor.from_pretrained(tiny_model_dir(real["variant"])).tokenizer
    config = _build_config(real["variant"], TinyModelSpec(**real["spec"]), tokenizer)
    config.text_config.vocab_size = real["vocab"]
    if "fullatt" in real:
        config.vision_config.fullatt_block_indexes = real["fullatt"]
    if text_layers:
        config.text_config.num_hidden_layers = text_layers
        config.text_config.max_window_layers = text_layers
        if getattr(config.text_config, "layer_types", None):
            config.text_config.layer_types = config.text_config.layer_types[:text_layers]
    if vision_layers:
        config.vision_config.depth = vision_layers
        if "fullatt" in real:  # keep the real mix: windowed layers, the last one full
            config.vision_config.fullatt_block_indexes = [vision_layers - 1]
    return config


def meta_model(shape: str, text_layers: int | None = None, vision_layers: int | None = None) -> Any:
    """A real shape's model on torch's meta device: every parameter's shape, no memory."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(real_config(shape, text_layers, vision_layers))


def build_policy(shape: str, device: str, text_layers: int | None = None, vision_layers: int | None = None,
                 **policy_kwargs: Any):
    """(HFPolicy, screenshot size) for a shape. Real shapes get random weights built on the device
    and 1080p screenshots at UI-TARS's pixel limits; `tiny` loads the local checkpoint.
    `text_layers` / `vision_layers` shrink a real shape's depth (a CPU check of the real widths)."""
    from arpo_lib.agent.hf_policy import HFPolicy, resolve_device

    device = str(resolve_device(device))  # "auto" -> cuda or cpu (torch.device("auto") is no device)
    if shape in ("tiny", "tiny25"):
        variant = "qwen2vl" if shape == "tiny" else "qwen25vl"
        if text_layers or vision_layers:
            raise ValueError("--text-layers/--vision-layers apply to the real shapes (2b, 7b)")
        return HFPolicy(tiny_model_dir(variant), device=device, **policy_kwargs), (320, 420)
    from transformers import AutoModelForImageTextToText

    path = tiny_model_dir(REAL_SHAPES[shape]["variant"])
    config = real_config(shape, text_layers, vision_layers)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    policy = HFPolicy(path, device=device, model=model, **policy_kwargs)
    use_uitars_pixel_limits(policy)
    return policy, (1920, 1080)


def use_uitars_pixel_limits(policy: Any) -> None:
    """UI-TARS's image limits on a policy's processor: a 1080p screenshot is not downscaled."""
    ip = policy.processor.image_processor
    min_pixels, max_pixels = 3136, 16384 * 28 * 28
    ip.size = type(ip.size)(shortest_edge=min_pixels, longest_edge=max_pixels)
    policy.resize = (28, min_pixels, max_pixels)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1,
          info: dict | None = None) -> tuple[float, Any]:
    """(median seconds, last result) over `repeats` runs after `warmup`. `info` receives
    `first_s`, the first warm-up call's seconds (a compile, a cold cache)."""
    out = None
    for i in range(warmup):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        if i == 0 and info is not None:
            info["first_s"] = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def max_rel_grad_diff(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> float:
    """max over the parameters both have of max|g - g_ref| / max|g_ref| (host tensors, compared in
    fp32 one at a time)."""
    worst = 0.0
    for name, ref in reference.items():
        if name not in grads:  # frozen on this path (frozenvision)
            continue
        ref32, g32 = ref.float(), grads[name].float()
        worst = max(worst, float((ref32 - g32).abs().max() / (ref32.abs().max() + 1e-12)))
    return worst


KERNEL_CATEGORIES = (  # first match wins; names of CUDA kernels and of aten ops on the CPU
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::baddbmm", "matmul", "sm90_", "ampere_")),
    ("copy / cast", ("copy", "memcpy", "memset", "aten::to", "cast")),
    ("reduction", ("reduce", "softmax", "norm", "sum", "aten::max", "logsumexp")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "elementwise / other")


def profile_summary(fn: Callable[[], Any], device: torch.device, top: int = 12) -> dict[str, Any]:
    """One call of `fn` under torch.profiler: its time split by kernel category and the `top`
    kernels (CUDA: GPU kernel time; CPU: the ops' own CPU time, which excludes their children).
    No trace file: a 7B step's trace is hundreds of MB; this summary is what RESULTS.md shows."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    events = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            events.append((e.key, e.count, us / 1e3))
    total = sum(ms for _, _, ms in events) or 1.0
    categories: dict[str, float] = {}
    for name, _, ms in events:
        category = kernel_category(name)
        categories[category] = categories.get(category, 0.0) + ms
    events.sort(key=lambda e: -e[2])
    return {
        "clock": "GPU kernel" if cuda else "CPU op self",
        "wall_s": wall, "kernel_ms": total,
        "categories": [{"category": c, "ms": ms, "share": ms / total}
                       for c, ms in sorted(categories.items(), key=lambda kv: -kv[1])],
        "top": [{"name": name[:90], "calls": n, "ms": ms, "share": ms / total} for name, n, ms in events[:top]],
    }


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def train_flops(model: Any, segment: Any) -> dict[str, float]:
    """Model FLOPs of one forward+backward over a segment (recomputation excluded).

    Every matmul counts 2 FLOPs per multiply-add; backward = 2 x forward, so each term is
    6 x (parameters used per token) x tokens, plus attention scores:
      text linears   6 * P_text_linear * T
      text attention 6 * 2 * L * H * d * T^2 / 2   (QK^T and AV, causal: half)
      LM head        6 * d_model * V * N_resp      (only the trained positions)
      vision linears 6 * P_vision * patches
      vision attn    6 * 2 * L_v * d_v * sum over windows/images of len^2
    """
    text = model.config.get_text_config()
    vision = model.config.vision_config
    tokens = len(segment.input_ids)
    responses = sum(segment.loss_mask)
    lm = model.model.language_model
    p_text = sum(p.numel() for n, p in lm.named_parameters() if n.endswith("weight") and p.dim() == 2
                 and "embed_tokens" not in n)
    p_vision = sum(p.numel() for n, p in model.model.visual.named_parameters() if p.dim() == 2)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    attn_text = 6 * 2 * text.num_hidden_layers * text.num_attention_heads * head_dim * tokens**2 / 2
    patches = 0
    sq_full = sq_window = 0
    window = getattr(vision, "window_size", None)
    patch = vision.patch_size
    merge = vision.spatial_merge_size
    for grid in segment.image_grid_thw:
        t, h, w = (int(x) for x in grid)
        n = t * h * w
        patches += n
        sq_full += n * n
        if window:  # windows of (window/patch/merge)^2 merged tokens = x merge^2 patches
            side = window // patch // merge
            mh, mw = h // merge, w // merge
            for rows in _spans(mh, side):
                for cols in _spans(mw, side):
                    sq_window += (rows * cols * merge * merge) ** 2 * t
    depth = vision.depth
    dim_v = getattr(vision, "embed_dim", None) or vision.hidden_size
    if window:
        full_layers = len(getattr(vision, "fullatt_block_indexes", []) or [])
        attn_vision = 6 * 2 * dim_v * (full_layers * sq_full + (depth - full_layers) * sq_window)
    else:
        attn_vision = 6 * 2 * dim_v * depth * sq_full
    out = {
        "text_linear": 6 * p_text * tokens,
        "text_attention": attn_text,
        "lm_head": 6 * text.hidden_size * text.vocab_size * responses,
        "vision_linear": 6 * p_vision * patches,
        "vision_attention": attn_vision,
    }
    out["total"] = sum(out.values())
    return out


def executed_flops(flops: dict[str, float], frozen_vision: bool = False, frozen_linears: bool = False) -> float:
    """The FLOPs a path actually runs. A frozen vision tower (its input is pixels) runs its forward
    only: 2 of the 6 x. Frozen Linear weights (LoRA's base model) skip their weight gradients: 4 of
    the 6 x (forward + input gradient); attention has no weights and keeps 6 x. LoRA's adapters are
    left out (under 1% at rank 16)."""
    linear = 4 / 6 if frozen_linears else 1.0
    vision = 2 / 6 if frozen_vision or frozen_linears else 1.0
    return (flops["text_linear"] * linear + flops["lm_head"] * linear + flops["text_attention"]
            + (flops["vision_linear"] + flops["vision_attention"]) * vision)


def _spans(n: int, size: int) -> list[int]:
    return [min(size, n - start) for start in range(0, n, size)]


def write_result(name: str, result: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


OSWORLD_TEST_TASKS = {"chrome": ["2ae9ba84-3a0d-4d4c-8338-3a1478dc5fe3", "bb5e4c0d-f964-439c-97b6-bdb9747de3f4"],
                      "os": ["b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa", "e0df059f-28a6-4169-924f-b9623e7184cc"]}
"""The four of OSWorld's own task files in test_data/osworld_tasks (unchanged), each with a scripted
solution for the desktop sandbox: the infeasible one (os) and the GNOME Terminal one (os) among them."""


def osworld_test_task_cache(parent: Path) -> Path:
    """A task cache under `parent` holding test_data/osworld_tasks' four OSWorld task files in
    OSWorld's tree layout, fetched as `osworld-tasks fetch --source <checkout>` fetches (the full
    data cannot be downloaded here). Point ARPO_OSWORLD_TASKS at the returned directory."""
    import json
    import os
    import shutil

    from arpo_lib.envs.osworld import tasks as ot

    root = Path(__file__).resolve().parents[1] / "test_data" / "osworld_tasks"
    tree = Path(parent) / "osworld" / "evaluation_examples"
    for domain, ids in OSWORLD_TEST_TASKS.items():
        (tree / "examples" / domain).mkdir(parents=True, exist_ok=True)
        for task_id in ids:
            shutil.copy(root / f"{task_id}.json", tree / "examples" / domain)
    (tree / ot.TEST_ALL_LIST).write_text(json.dumps(OSWORLD_TEST_TASKS))
    (tree / ot.TRAIN_LIST).write_text(json.dumps({"chrome": OSWORLD_TEST_TASKS["chrome"]}))
    cache = Path(parent) / "osworld-tasks"
    saved = os.environ.get(ot.ENV_VAR)
    os.environ[ot.ENV_VAR] = str(cache)
    try:
        ot.fetch_tasks(tree.parent, progress=False,
                       expect=ot.Expectations(lists={ot.TEST_ALL_LIST: 4}, set_sizes={"sandbox_solved": 4}))
    finally:
        os.environ.pop(ot.ENV_VAR) if saved is None else os.environ.__setitem__(ot.ENV_VAR, saved)
    return cache
