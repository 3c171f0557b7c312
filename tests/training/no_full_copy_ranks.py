"""Run under torchrun by tests/training/test_distributed_gpu.py: the FSDP2 backend without a full
copy of the model (keep_full_model=False, what a run with model servers uses), on gloo ranks.

Every rank trains the tiny model's shards one AdamW step on the same two trajectories, beside a
whole copy that one process steps the same way (the reference; only this script holds it). Then:
the model the backend saves (rank 0 writes, every rank gathers), and a pass over its weights as a
push streams them (rank 0 consumes `full_tensors`, the others `join_full_weights`), with a spy
on how many gathered parameters are alive at once. Prints one JSON line (rank 0)."""
from __future__ import annotations

import copy
import gc
import json
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.serving.weight_sync import full_tensors
from arpo_lib.training.backend import FSDP2
from arpo_lib.training.distributed import Ranks, close_process_group
from benchmarks.common import synthetic_trajectory

LR = 1e-4


def main(model: str, out: str) -> None:
    ranks = Ranks.from_env()
    dist.init_process_group("gloo")
    policy = HFPolicy(model, device="cpu", gradient_checkpointing=True)
    segments = [synthetic_trajectory(policy, 2, (320, 420), seed=s) for s in range(2)]
    reference = copy.deepcopy(policy.model)  # what one process with the whole model would hold
    backend = FSDP2(policy, ranks, keep_full_model=False, micro_batch_size=2)
    still_whole = not any(p.is_meta for p in policy.model.parameters())

    # The update as the trainer runs it: old log-probs (the full copy is dropped here), the step.
    # The optimizer before any forward, as the trainer makes it: after a forward, FSDP2's root unit
    # holds its unsharded parameters until the next backward, and parameters() would list those.
    opt = torch.optim.AdamW(backend.parameters(), lr=LR, weight_decay=0.0)
    plan = backend.plan([(s, 1.0) for s in segments])
    backend.old_logprobs([plan], 1.0)
    dropped = all(p.is_meta for p in policy.model.parameters())
    backend.train_mode()
    tokens = sum(sum(s.loss_mask) for s in segments)  # the whole batch's: each rank's share of its loss
    for micro, live in plan:
        lps = backend.logprobs([s for s, _ in micro], 1.0)
        backend.backward(-torch.cat(lps).sum() / tokens, 1.0, live)
    opt.step()
    backend.after_update(stepped=True)

    reference.train()  # one process, the whole model, the same loss over both trajectories
    (-torch.cat(policy.sequence_logprobs(segments, 1.0, model=reference)).sum() / tokens).backward()
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.0).step()

    # The model saved without a full copy: rank 0 writes, every rank gathers.
    saved_dir = Path(out) / "saved"
    backend.save_policy(saved_dir)
    dist.barrier()

    # A push's pass: rank 0 consumes the gathered tensors one at a time; the spy counts how many
    # gathered tensors are alive when each new one is handed over.
    most_alive, pushed = 0, {}
    if ranks.rank == 0:
        params = backend.full_weights()
        alive: list[weakref.ref] = []
        for name, full in full_tensors(params, torch.device("cpu"), [p.dtype for _, p in params]):
            gc.collect()
            alive = [r for r in alive if r() is not None]
            most_alive = max(most_alive, len(alive))
            alive.append(weakref.ref(full))
            pushed[name] = full.clone()  # a copy: the spy watches the handed-over tensor itself
            del full
    else:
        backend.join_full_weights()
    dist.barrier()

    if ranks.rank == 0:
        files = load_file(str(saved_dir / "model.safetensors"))
        with tempfile.TemporaryDirectory() as d:
            reference.save_pretrained(d)
            expected = load_file(str(Path(d) / "model.safetensors"))
        weights = dict(reference.named_parameters())
        weight_gap = max(float((files[k] - expected[k]).abs().max()) for k in expected)
        moved = max(float((p - before[n]).abs().max()) for n, p in weights.items())
        # as whole vectors too (tests/training/test_distributed.py::_assert_same says why)
        gap_norm = float(torch.cat([(files[k] - expected[k]).flatten() for k in expected]).norm())
        moved_norm = float(torch.cat([(p - before[n]).detach().flatten() for n, p in weights.items()]).norm())
        push_gap = max(float((pushed[n] - weights[n]).abs().max()) for n in pushed)

        print(json.dumps({"world_size": ranks.world_size, "whole_at_start": still_whole, "dropped": dropped,
                          "saved_keys_equal": sorted(files) == sorted(expected), "weight_gap": weight_gap,
                          "moved": moved, "gap_norm": gap_norm, "moved_norm": moved_norm, "lr": LR, "pushed_tensors": len(pushed), "tensors": len(weights),
                          "most_alive_at_a_handover": most_alive, "push_gap": push_gap,
                          "processor_saved": (saved_dir / "processor_config.json").is_file()}))
    del backend, opt
    close_process_group(ranks)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
