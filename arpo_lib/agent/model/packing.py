"""Several trajectories in one row without padding, for the training forward pass.

Right-padding a micro-batch of sequences of different lengths computes on padding; packing puts
them end to end in one row instead. Each sequence keeps its own M-RoPE positions (from the
model's own `get_rope_index`), and a fourth row of plain per-sequence text positions, restarting
at 0, goes first: transformers then builds a block-diagonal causal mask from it (its packed-
sequence support), so no token attends across a boundary. Same log-probs as separate rows
(tests/agent/model/test_training_levers.py). With SDPA that mask is a dense (T, T) boolean tensor (T^2 bytes:
256 MB at 16k tokens), and SDPA cannot take its flash kernel with a mask, so packing pays only
where padding would be large; benchmarks/bench_update.py measures it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def rope_positions(model: Any, input_ids: Sequence[int], mm_token_type_ids: Sequence[int],
                   image_grid_thw: Sequence[torch.Tensor]) -> torch.Tensor:
    """M-RoPE positions (3, 1, T) of one sequence, from the model's own `get_rope_index`."""
    ids = torch.tensor([list(input_ids)])
    if not image_grid_thw:
        return torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    positions, _ = model.model.get_rope_index(
        ids, torch.tensor([list(mm_token_type_ids)], dtype=torch.int), image_grid_thw=torch.stack(list(image_grid_thw)),
        attention_mask=torch.ones_like(ids))
    return positions  # (3, 1, T)


def pack_segments(model: Any, segments: Sequence[Any]) -> dict[str, torch.Tensor]:
    """One row holding every segment: input_ids (1, T), position_ids (4, 1, T), loss_mask (1, T),
    and the images of all segments in order. No attention mask: the positions carry the boundaries."""
    ids, mm, mask, positions, text_positions = [], [], [], [], []
    for seg in segments:
        ids += seg.input_ids
        mm += seg.mm_token_type_ids
        mask += seg.loss_mask
        positions.append(rope_positions(model, seg.input_ids, seg.mm_token_type_ids, seg.image_grid_thw))
        text_positions.append(torch.arange(len(seg)))
    rope = torch.cat(positions, dim=2)  # (3, 1, T)
    text = torch.cat(text_positions).view(1, 1, -1)  # (1, 1, T): restarts at 0 per segment
    out = {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.cat([text, rope], dim=0),  # (4, 1, T)
        "loss_mask": torch.tensor([mask]),
        "mm_token_type_ids": torch.tensor([mm], dtype=torch.int),
    }
    pixels = [p for s in segments for p in s.pixel_values]
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.stack([g for s in segments for g in s.image_grid_thw])
    return out
