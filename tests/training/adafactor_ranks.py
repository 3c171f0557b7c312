"""Run by tests/training/test_optim_sharded.py under torchrun (2 gloo processes): ShardedAdafactor on
FSDP2 shards against torch's Adafactor on whole tensors in each process, then the sharded state
written with torch.distributed.checkpoint. Prints one JSON line (rank 0) with the gaps."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from arpo_lib.training.checkpoint import save_optimizer_shards
from arpo_lib.training.distributed import Ranks, close_process_group
from arpo_lib.training.optim import ShardedAdafactor


class Shapes(torch.nn.Module):
    """Every case: 2-D with an odd row count (uneven shards), a 2-D row shard one rank lacks
    (1 row), a 3-D tensor (its columns stay local), vectors (biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.cube = torch.nn.Parameter(torch.randn(3, 2, 4))
        self.row = torch.nn.Parameter(torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(self.a(x)).sum() + (self.cube ** 2).sum() * x.mean() + (self.row * x[:, :4]).sum()) ** 2


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    sharded, whole = Shapes(), Shapes()
    whole.load_state_dict(sharded.state_dict())
    fully_shard(sharded.a)
    fully_shard(sharded)
    opt = ShardedAdafactor(sharded.parameters(), lr=0.01, weight_decay=0.1)
    ref = torch.optim.Adafactor(whole.parameters(), lr=0.01, weight_decay=0.1)
    start = {k: v.clone() for k, v in whole.state_dict().items()}
    for i in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        for model, o in ((sharded, opt), (whole, ref)):
            model(x).backward()
            o.step()
            o.zero_grad()
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    weight_gap = max(float((full[k] - v).abs().max()) for k, v in whole.state_dict().items())
    moved = max(float((v - start[k]).abs().max()) for k, v in whole.state_dict().items())
    gathered = get_optimizer_state_dict(sharded, opt, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in whole.named_parameters()]
    state_gap = max(float(((gathered["state"][names[i]][k] - v).abs() / v.abs().clamp(min=1e-12)).max())
                    for i, st in ref.state_dict()["state"].items() for k, v in st.items())
    placements = {k: str(v.placements) for k, v in opt.state[sharded.a.weight].items() if hasattr(v, "placements")}
    holder = torch.nn.Module()
    holder.net = sharded  # the parameter names of a trainer's sharded copy (net.*)
    save_optimizer_shards(Path(out), holder, opt)  # -> out/optimizer_shards/, a shard per rank
    if dist.get_rank() == 0:
        torch.save({"model": whole.state_dict(), "optimizer": ref.state_dict()}, Path(out) / "whole.pt")
        print(json.dumps({"weight_gap": weight_gap, "moved": moved, "state_gap": state_gap,
                          "placements": placements, "keys": sorted(opt.state[sharded.a.weight])}))
    del sharded, opt, holder, gathered, full  # the FSDP2 module freed before the group ends (close_process_group)
    close_process_group(Ranks(rank=dist.get_rank(), world_size=2, local_rank=dist.get_rank()))


if __name__ == "__main__":
    main(sys.argv[1])
