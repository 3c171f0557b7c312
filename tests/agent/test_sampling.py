"""The per-row seeded Gumbel sampler (arpo_lib/agent/sampling.py)."""
from __future__ import annotations

import torch

from arpo_lib.agent.sampling import SeededGumbelSampler


def _reference_scores(seeds, logits_per_call, temperature, top_p, suppress_ids):
    """The sampler as it was before its draws moved to the logits' device: per row, a CPU
    generator seeded once, V uniforms per call, copied to the logits' device."""
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    out = []
    for scores in logits_per_call:
        logp = torch.log_softmax(scores.float() / temperature, dim=-1)
        if suppress_ids:
            logp[:, suppress_ids] = float("-inf")
            logp = torch.log_softmax(logp, dim=-1)
        if top_p < 1.0:
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            cum = sorted_logp.exp().cumsum(dim=-1)
            drop_sorted = (cum - sorted_logp.exp()) >= top_p
            logp = logp.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        uniform = torch.stack([torch.rand(logp.shape[-1], generator=g) for g in generators]).to(logp.device)
        out.append(logp - torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7))))
    return out


def test_sampler_on_the_cpu_draws_exactly_as_before():
    """Per-episode seeds keep their streams: on the CPU every score is bit-identical to the old
    sampler's, call after call (so recorded CPU runs reproduce)."""
    torch.manual_seed(0)
    seeds, vocab = [7, 123, 2**31 - 2], 1000
    calls = [torch.randn(len(seeds), vocab) * 3 for _ in range(4)]
    for top_p, suppress in [(1.0, []), (0.9, [0, 5])]:
        sampler = SeededGumbelSampler(seeds, 0.8, top_p, suppress)
        expected = _reference_scores(seeds, calls, 0.8, top_p, suppress)
        for logits, want in zip(calls, expected):
            assert torch.equal(sampler(None, logits.clone()), want)


def test_sampler_draws_on_the_logits_device(monkeypatch):
    """The uniforms are drawn where the logits are, from generators on that device: no
    B x vocab host tensor copied per token. (Fails on the old sampler, which drew on the host.)"""
    devices = []
    real_rand = torch.rand

    def spy(*args, **kwargs):
        devices.append(kwargs.get("device"))
        return real_rand(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", spy)
    logits = torch.randn(3, 50)
    sampler = SeededGumbelSampler([1, 2, 3], 1.0, 1.0, [])
    sampler(None, logits)
    assert devices == [logits.device] * 3
    assert [g.device for g in sampler.generators] == [logits.device] * 3
