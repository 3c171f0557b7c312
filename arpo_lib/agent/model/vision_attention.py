"""The vision tower's windowed attention in a few batched SDPA calls instead of a Python loop.

Qwen2-VL's vision tower attends within each image, and Qwen2.5-VL's within 112x112-pixel windows
in most layers. Without flash-attn, transformers' SDPA path splits the packed patch sequence at
every boundary and calls attention once per window: a 1080p screenshot is ~170 windows, so 15
screenshots make ~2,500 tiny kernel launches per layer. Windows come in very few sizes (full
windows, right/bottom edges, a corner; whole images of the same size), so here every window of one
size is gathered into a batch and attended in one SDPA call: exact, same numbers up to float
rounding, on any device, no extra package.

Transformers hands the boundaries (`cu_seq_lens_q`) only to attention implementations whose name
contains "flash", hence the registered name. Only the vision sub-model uses it; the language
model keeps SDPA.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IMPLEMENTATION = "arpo_flash_varlen_sdpa"


def varlen_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None = None, *, scaling: float | None = None, dropout: float = 0.0,
                cu_seq_lens_q: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Block-diagonal (per window) attention over a packed sequence.

    query/key/value: (1, H, S, D); cu_seq_lens_q: (n_windows + 1,) window boundaries.
    Returns (1, S, H, D), as transformers' attention functions do.
    """
    q, k, v = query[0], key[0], value[0]  # (H, S, D)
    heads, seq, dim = q.shape
    if cu_seq_lens_q is None:  # one window: plain attention
        cu_seq_lens_q = torch.tensor([0, seq], device=q.device)
    starts, lengths = cu_seq_lens_q[:-1], cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    out = q.new_empty(heads, seq, dim)
    for length in lengths.unique().tolist():  # a handful of distinct window sizes
        if length == 0:
            continue
        first = starts[lengths == length]
        index = (first[:, None] + torch.arange(length, device=q.device)).reshape(-1)  # (n * L,)
        n = first.shape[0]

        def group(t: torch.Tensor) -> torch.Tensor:
            return t[:, index].view(heads, n, length, dim).transpose(0, 1)  # (n, H, L, D)

        attended = F.scaled_dot_product_attention(group(q), group(k), group(v), scale=scaling,
                                                  dropout_p=dropout if module.training else 0.0)
        out[:, index] = attended.transpose(0, 1).reshape(heads, n * length, dim)
    return out.transpose(0, 1).unsqueeze(0), None


def use_batched_vision_attention(model: Any) -> None:
    """Route the vision tower of a Qwen2-VL / Qwen2.5-VL model through `varlen_sdpa`."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, varlen_sdpa)
    model.set_attn_implementation({"vision_config": IMPLEMENTATION})


def use_looped_vision_attention(model: Any) -> None:
    """Transformers' own path: one SDPA call per window (the naive baseline)."""
    model.set_attn_implementation({"vision_config": "sdpa"})
