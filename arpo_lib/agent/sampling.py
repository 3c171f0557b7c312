"""Per-episode seeded sampling, shared by every generation path of the in-process policy.

Each row of a batch samples with its own generator, so an episode's tokens do not depend on
which other episodes share the batch: runs and resumes reproduce whatever order the
environments answer in. The generators live on the logits' device, so the noise is drawn there
(no B x vocab host-to-device copy per token); on the CPU the draws are those of a CPU generator
with the same seed, and on an accelerator its own generator's stream (same seed, other numbers).
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
        self.seeds = [int(s) for s in seeds]
        self.generators: list[torch.Generator] = []
        """One per row, made on the first call on the device of the logits."""
        self.temperature = temperature
        self.top_p = top_p
        self.suppress_ids = list(suppress_ids)
        self._suppress: torch.Tensor | None = None
        """The suppressed ids on the logits' device, made once (not a host list at every token)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        if self.suppress_ids:
            if self._suppress is None or self._suppress.device != logp.device:
                self._suppress = torch.tensor(self.suppress_ids, device=logp.device)
            logp.index_fill_(1, self._suppress, float("-inf"))
            logp = torch.log_softmax(logp, dim=-1)  # renormalise, as the behaviour log-probs do
        if self.top_p < 1.0:
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            cum = sorted_logp.exp().cumsum(dim=-1)
            drop_sorted = (cum - sorted_logp.exp()) >= self.top_p  # keep the smallest set reaching top_p
            logp = logp.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        if not self.generators:
            self.generators = [torch.Generator(device=logp.device).manual_seed(s) for s in self.seeds]
        vocab = logp.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g, device=logp.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
        return logp + gumbel
