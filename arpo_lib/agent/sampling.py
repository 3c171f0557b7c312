"""Per-episode seeded sampling, shared by every generation path of the in-process policy.

Each row of a batch samples with its own generator, so an episode's tokens do not depend on
which other episodes share the batch: runs and resumes reproduce whatever order the
environments answer in.
"""
from __future__ import annotations

from typing import Sequence

import torch


class SeededGumbelSampler:
    """A logits processor that turns greedy decoding into per-row seeded sampling.

    For each row it adds Gumbel noise from that row's own generator to log softmax(logits / T)
    (with suppressed and out-of-nucleus tokens at -inf); the argmax is then a sample from the
    (nucleus-truncated) softmax(logits / T) -- the Gumbel-max trick.
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, suppress_ids: Sequence[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p
        self.suppress_ids = list(suppress_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        if self.suppress_ids:
            logp[:, self.suppress_ids] = float("-inf")
            logp = torch.log_softmax(logp, dim=-1)  # renormalise, as the behaviour log-probs do
        if self.top_p < 1.0:
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            cum = sorted_logp.exp().cumsum(dim=-1)
            drop_sorted = (cum - sorted_logp.exp()) >= self.top_p  # keep the smallest set reaching top_p
            logp = logp.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        uniform = torch.stack([torch.rand(logp.shape[-1], generator=g) for g in self.generators]).to(logp.device)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
        return logp + gumbel
