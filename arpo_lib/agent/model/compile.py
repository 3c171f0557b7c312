"""torch.compile of the language model's decoder layers, one layer at a time, and its undoing.

Each decoder layer is compiled in place (`nn.Module.compile`): the layers share one graph (their
weights are graph inputs), activation checkpointing stays outside the compiled call (transformers'
`GradientCheckpointingLayer.__call__` wraps `nn.Module.__call__`, which runs the compiled forward,
in the recompute too), and the vision tower, whose windowed attention reads window sizes on the
host, stays eager. A lever of the GPU benchmarks (benchmarks/bench_update.py, path `ours+compile`);
the trainer does not use it until a GPU figure says it pays.
"""
from __future__ import annotations

from typing import Any

import torch


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The language model's decoder layers of a Qwen2-VL / Qwen2.5-VL model (bare or under peft)."""
    for module in model.modules():
        layers = getattr(getattr(module, "language_model", None), "layers", None)
        if layers is not None:
            return list(layers)
    raise ValueError(f"{type(model).__name__} has no language_model.layers to compile")


def compile_decoder_layers(model: Any, backend: str = "inductor", dynamic: bool | None = None,
                           mode: str | None = None) -> int:
    """Compile every decoder layer in place; returns how many. `backend="aot_eager"` traces and
    runs the same graphs without generating kernels (a quick check of the machinery on a CPU)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=dynamic, mode=mode)
    return len(layers)


def uncompile_decoder_layers(model: Any) -> None:
    """Back to the eager forward (the compiled graphs stay in dynamo's cache)."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


def is_compiled(model: Any) -> bool:
    return any(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))
