"""ShardedAdafactor: torch's Adafactor update on FSDP2 shards (several processes), and its state
in torch.distributed.checkpoint files that one process with torch's own Adafactor reads back."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arpo_lib.training.checkpoint import load_optimizer_shards
from arpo_lib.training.optim import ShardedAdafactor, make_optimizer

HERE = Path(__file__).resolve().parent


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(5, 6), (5,), (3, 2, 4), (1, 4)]]


def test_on_whole_tensors_it_is_torchs_adafactor():
    ours, theirs = _params(0), _params(0)
    opt_ours = ShardedAdafactor(ours, lr=0.02, weight_decay=0.05)
    opt_theirs = torch.optim.Adafactor(theirs, lr=0.02, weight_decay=0.05)
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        for params, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            g = torch.Generator().manual_seed(100 + step)
    for a, b, start in zip(ours, theirs, _params(0)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - start).abs().max() > 1e-3
    for a, b in zip(ours, theirs):
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        assert sa.keys() == sb.keys()  # the same state keys: checkpoints move between the two
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=0)


def test_make_optimizer_picks_it_only_for_sharded_parameters():
    assert type(make_optimizer("adafactor", _params(0), 0.1, 0.0)) is torch.optim.Adafactor


def test_two_ranks_step_fsdp_shards_like_one_process_and_one_process_resumes_their_shards(tmp_path):
    """2 gloo processes: the sharded update equals torch's on whole tensors (weights and the
    gathered state), the state is sharded (row statistics Shard(0), 2-D column statistics
    Replicate), and the torch.distributed.checkpoint files they wrote in parallel load into
    torch's own Adafactor in a single process (re-sharded to whole tensors)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           str(HERE / "adafactor_ranks.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["weight_gap"] < 1e-6 and report["moved"] > 1e-3, report
    assert report["state_gap"] < 1e-5, report
    assert report["keys"] == ["col_var", "row_var", "step"]
    assert report["placements"] == {"row_var": "(Shard(dim=0),)", "col_var": "(Replicate(),)"}
    assert sorted(p.name for p in (tmp_path / "optimizer_shards").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                  "__1_0.distcp"]
    # one process, torch's Adafactor: the shards come back whole and equal to what it computed itself
    whole = torch.load(tmp_path / "whole.pt")
    from tests.training.adafactor_ranks import Shapes

    holder = torch.nn.Module()
    holder.net = Shapes()
    holder.net.load_state_dict(whole["model"])
    opt = torch.optim.Adafactor(holder.parameters(), lr=0.01, weight_decay=0.1)
    load_optimizer_shards(tmp_path / "optimizer_shards", holder, opt)
    for i, p in enumerate(holder.parameters()):
        for key, value in whole["optimizer"]["state"][i].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=0)


def test_maximize_is_refused_rather_than_ignored():
    params = _params(0)
    opt = ShardedAdafactor(params, lr=0.1, maximize=True)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="maximize"):
        opt.step()
