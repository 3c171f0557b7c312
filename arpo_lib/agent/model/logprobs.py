"""Token log-probs from decoder hidden states in chunks, logits recomputed in the backward pass.

The naive path applies the LM head to every trained position at once: (N, V) logits, their
float copy and the log-softmax output all stay alive until backward (about 3 x N x V x 4 bytes: 1.6
GiB for 900 response tokens at Qwen's V = 152k). Here the positions go through the head `chunk`
at a time under activation checkpointing, so only the hidden states (N, H) are kept and at most one
chunk's logits exist, in forward and in backward. Same numbers; the LM head runs twice.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: torch.nn.Module, temperature: float,
                    suppress_ids: Sequence[int]) -> torch.Tensor:
    logits = head(hidden).float() / temperature  # (n, V)
    if suppress_ids:  # the distribution sampling used
        logits[..., list(suppress_ids)] = float("-inf")
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: torch.nn.Module, *, temperature: float = 1.0,
                   suppress_ids: Sequence[int] = (), chunk: int = 0) -> torch.Tensor:
    """log softmax(head(hidden) / T)[token] for each row: hidden (N, H), tokens (N,) -> (N,).

    chunk = 0 is the naive path (all rows at once). chunk > 0 processes `chunk` rows at a time,
    recomputing their logits in backward when gradients are needed.
    """
    if chunk <= 0 or hidden.shape[0] <= chunk:
        return _chunk_logprobs(hidden, tokens, head, temperature, suppress_ids)
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], tokens[start:start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, h, t, head, temperature, suppress_ids, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, t, head, temperature, suppress_ids))
    return torch.cat(parts)


class LogprobNet(torch.nn.Module):
    """A model and its training forward as ONE module call: (padded batch, target mask,
    temperature) -> the target tokens' log-probs (`HFPolicy.sequence_logprobs`). Sharded with
    FSDP2 (arpo_lib/training/distributed.py), its root unit (embeddings, final norm, the LM head
    tied to them, the vision merger) is then gathered once around the whole forward."""

    def __init__(self, net: torch.nn.Module, forward_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.net = net
        self._forward_fn = forward_fn

    def forward(self, batch: dict[str, torch.Tensor], targets: torch.Tensor, temperature: float) -> torch.Tensor:
        # A fresh tensor, not a view: FSDP hooks the output for its backward
        return self._forward_fn(self.net, batch, targets, temperature).clone()
