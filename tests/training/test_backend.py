"""The training backend's work split: every sequence of a mini-batch is trained exactly once over
the ranks, every rank runs as many forwards (padding micro-batches count 0), and one process
trains the policy's own parameters in the micro-batches the config asks for."""
from __future__ import annotations

import torch

from arpo_lib import build
from arpo_lib.run.config import load_config
from arpo_lib.training.backend import SingleProcess, rank_plan, training_backend
from arpo_lib.training.distributed import SINGLE


class Seq:
    """A stand-in for a segment: only its length matters to the split."""

    def __init__(self, name: str, n: int):
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return self.name


def two_at_a_time(seqs):
    return [seqs[i:i + 2] for i in range(0, len(seqs), 2)]


def test_ranks_share_a_minibatch_by_tokens_and_pad_to_the_busiest():
    seqs = [(Seq("a", 900), 1.0), (Seq("b", 100), -1.0), (Seq("c", 450), 0.5), (Seq("d", 400), -0.5),
            (Seq("e", 50), 1.0)]
    plans = [rank_plan(seqs, two_at_a_time, rank, 2) for rank in (0, 1)]
    # longest first to the least-loaded rank: 0 gets a (900) and e (50); 1 gets c, d, b (950)
    assert [[([s.name for s, _ in m], live) for m, live in plan] for plan in plans] == [
        [(["a", "e"], True), (["e"], False)],   # padded with the shortest sequence, not live
        [(["b", "c"], True), (["d"], True)]]
    live = [s.name for plan in plans for m, alive in plan if alive for s, _ in m]
    assert sorted(live) == ["a", "b", "c", "d", "e"]  # every sequence trained once
    assert rank_plan([], two_at_a_time, 1, 2) == []


def test_one_process_trains_the_policys_parameters_in_the_configured_micro_batches(tmp_path, tiny_qwen2vl):
    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}"])
    policy = build.hf_policy(cfg)
    backend = training_backend(policy, SINGLE, micro_batch_size=2, token_budget=0, pack=False)
    assert isinstance(backend, SingleProcess) and backend.is_main
    assert backend.parameters() == policy.trainable_parameters()
    seqs = [(Seq(n, 10), 1.0) for n in "abcde"]
    assert [([s.name for s, _ in m], live) for m, live in backend.plan(seqs)] == [
        (["a", "b"], True), (["c", "d"], True), (["e"], True)]
    assert backend.share([1, 2, 3]) == [1, 2, 3] and backend.gather([1, 2]) == [1, 2]
    assert backend.all_reduce_sum([0.5, 2.0]) == [0.5, 2.0] and backend.broadcast("x") == "x"
    # the gradient of a micro-batch counts its share of the mini-batch; padding counts nothing
    w = torch.ones(3, requires_grad=True)
    backend.backward((w * 2).sum(), 0.25, live=True)
    backend.backward((w * 100).sum(), 1.0, live=False)
    assert torch.equal(w.grad, torch.full((3,), 0.5))
