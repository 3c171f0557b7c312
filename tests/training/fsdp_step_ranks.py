"""Run under torchrun by tests/training/test_distributed_gpu.py: the training forward+backward and
an AdamW step of the tiny Qwen2.5-VL-architecture model on its FSDP2-sharded copy (NCCL on CUDA,
gloo on the CPU), against the same on the whole model in the same process. Every rank trains on the
same two trajectories, so the averaged sharded gradient must equal the whole model's. Activation
checkpointing on; `frozen-vision` adds model.freeze_vision_tower; `bf16` computes in bf16 (FSDP2's
parameter dtype, fp32 reduction; autocast for the whole model), CUDA's default, here on gloo too.
Prints one JSON line (rank 0) with the gaps."""
from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.training.backend import FSDP2
from arpo_lib.training.distributed import Ranks, close_process_group, shard_for_training, sync_full_model
from benchmarks.common import synthetic_trajectory

LR = 1e-4


def main(kind: str, model: str, frozen_vision: bool = False, bf16: bool = False) -> None:
    ranks = Ranks.from_env()
    cuda = kind == "cuda"
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    policy = HFPolicy(model, device=f"cuda:{ranks.local_rank}" if cuda else "cpu", gradient_checkpointing=True,
                      freeze_vision_tower=frozen_vision, compute_dtype="bfloat16" if bf16 else "auto")
    policy.model.train()
    segments = [synthetic_trajectory(policy, 2, (320, 420), seed=s) for s in range(2)]
    gathered = copy.deepcopy(policy.model)  # receives the sharded weights after the step
    net = shard_for_training(policy.model, policy.forward_logprobs, compute_dtype=policy.compute_dtype)

    # The FSDP2 backend's old log-probs: from its shards, on the update's micro-batch plan, so the
    # first micro-batch's new log-probs (with grad, in training mode) equal them exactly.
    backend = FSDP2(policy, ranks, micro_batch_size=2)
    plan = backend.plan([(s, 1.0) for s in segments])
    old = backend.old_logprobs([plan], 1.0)
    backend.train_mode()
    first = [s for s, _ in plan[0][0]]
    new = backend.logprobs(first, 1.0)
    first_ratio_gap = max(float((lp.detach().cpu() - old[id(s)]).abs().max()) for s, lp in zip(first, new))
    torch.cat(new).sum().backward()  # FSDP2's cycle completed; these gradients are not used
    policy.model.train()

    whole_lp = torch.cat(policy.sequence_logprobs(segments))
    (-whole_lp.mean()).backward()
    sharded_lp = torch.cat(policy.sequence_logprobs(segments, model=net))
    (-sharded_lp.mean()).backward()

    grad_gap, trained = 0.0, 0
    for (name, p), (_, q) in zip(policy.model.named_parameters(), net.net.named_parameters()):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
        if p.grad is None:
            continue
        trained += 1
        full = q.grad.full_tensor().float()
        grad_gap = max(grad_gap, float((full - p.grad.float()).abs().max() / (p.grad.abs().max() + 1e-12)))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    for module in (policy.model, net):
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
        opt.step()
    sync_full_model(net, gathered)
    with torch.no_grad():
        weights = dict(gathered.named_parameters())
        weight_gap = max(float((weights[n] - p).abs().max()) for n, p in policy.model.named_parameters())
        moved = max(float((p - before[n]).abs().max()) for n, p in policy.model.named_parameters())
    if ranks.rank == 0:
        print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "world_size": ranks.world_size,
                          "compute_dtype": str(policy.compute_dtype),
                          "logprob_gap": float((whole_lp - sharded_lp).detach().abs().max()),
                          "first_ratio_gap": first_ratio_gap,
                          "grad_gap": grad_gap, "weight_gap": weight_gap, "moved": moved, "lr": LR,
                          "trained_tensors": trained, "tensors": len(before)}))
    del net, opt, backend  # the FSDP2 modules freed before the group ends (close_process_group)
    close_process_group(Ranks(rank=ranks.rank, world_size=max(2, ranks.world_size), local_rank=ranks.local_rank))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], frozen_vision="frozen-vision" in sys.argv[3:], bf16="bf16" in sys.argv[3:])
