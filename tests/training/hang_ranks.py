"""Run under torchrun by tests/training/test_distributed.py (2 gloo processes): where rank 0
works alone or fails, the others neither die at a collective timeout nor wait for one.

The GPU layout, with gloo standing in for NCCL: the default group (FSDP2's gathers, the weights'
broadcast) has a collective timeout given on the command line, short where a test shows that
nothing waits on it; the control group is a gloo side group with `CONTROL_TIMEOUT`, as
`distributed.init_process_group` makes on GPUs. Each rank writes what happened to it to
OUT/rank<R>.json. Scenarios:

- late-warm-start: rank 0's warm start outlasts the collective timeout; the weights still arrive.
- failed-warm-start: rank 0's warm start raises, then rank 0 lingers (a trainer closing its
  environments); rank 1 raises at once, with rank 0's error.
- failed-checkpoint: rank 0's part of a checkpoint fails (a full disk) and rank 0 lingers; rank 1
  raises at once, with rank 0's error.
- other-fails-mid-pass: rank 1 fails in a pass over the weights (its own error, mid-gather);
  rank 0, inside that gather, is stopped when rank 1 exits.
- push: a DCP checkpoint of a sharded optimizer round-trips, planned on the control group; a
  whole pass over the shards' weights; then a pass whose consumer fails at its third tensor
  (a server gone mid-push) while rank 0 lingers: rank 1 raises at once.
- push-fails-before / push-fails-mid: the trainer's own path to a push, `RolloutSource.weights_changed`
  over the FSDP2 backend without a full copy, where rank 0's servers fail before the first gather
  (a refused `/pause`) or at the third tensor (a server gone); rank 0 lingers; rank 1 raises at
  once with rank 0's error.
"""
from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from arpo_lib.run.layout import RunDir
from arpo_lib.training import distributed, sft
from arpo_lib.training.backend import TrainingBackend
from arpo_lib.training.distributed import Ranks

WARM_START_S = 6.0
"""How long rank 0's warm start takes in late-warm-start (the collective timeout there: 3 s)."""
LINGER_S = 10.0
"""How long a failed rank 0 stays alive, at most: until rank 1 has reported."""


class FullModelBackend(TrainingBackend):
    """FSDP2's warm-start half without the shards: every rank holds the whole model, rank 0's
    weights go to all (`broadcast_model`). The update's methods are never called here."""

    def after_warm_start(self) -> None:
        distributed.broadcast_model(self.policy.model, self.ranks)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.policy.model.parameters())

    def logprobs(self, segments: Any, temperature: float) -> Any:
        raise NotImplementedError("not part of the warm start")

    def plan(self, sequences: Any) -> Any:
        raise NotImplementedError("not part of the warm start")

    def load_optimizer_state(self, optimizer: Any, state: Any) -> None:
        raise NotImplementedError("not part of the warm start")


def warm_start_on_rank_0(ranks: Ranks, out: Path, fail: bool) -> dict[str, Any]:
    """`WarmStart.warm_start` over `FullModelBackend`, its supervised training replaced by a
    stand-in that takes `WARM_START_S` on rank 0 (or raises there after 1 s)."""
    torch.manual_seed(ranks.rank)  # different weights on each rank until the broadcast
    model = torch.nn.Linear(4, 3)

    def train(policy: Any, demos: Any, **_: Any) -> list[float]:
        if fail:
            time.sleep(1.0)
            raise RuntimeError("CUDA out of memory (injected)")
        time.sleep(WARM_START_S)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.fill_(7.0)
        return [0.25]

    sft.warm_start = train
    policy = SimpleNamespace(model=model)
    backend = FullModelBackend(policy, ranks)  # type: ignore[arg-type]
    warm = sft.WarmStart(policy, backend, pool=lambda: None, run=RunDir(out / "run"), tasks=[],  # type: ignore[arg-type]
                         demos_per_task=0, steps=1, lr=0.0, batch_size=1, demo_replay=0, seed=0, max_steps=1,
                         progress=False)
    t0 = time.monotonic()
    try:
        losses = warm.warm_start()
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0, "losses": losses,
            "weights": [float(v) for p in model.parameters() for v in p.detach().flatten()]}


def failed_checkpoint(ranks: Ranks, out: Path) -> dict[str, Any]:
    """`Checkpointer.save` whose rank-0 part fails (a full disk): every rank raises at once."""
    from arpo_lib.training import checkpoint

    def full_disk(*_: Any, **__: Any) -> None:
        time.sleep(1.0)
        raise OSError("No space left on device (injected)")

    checkpoint.save_checkpoint = full_disk
    backend = FullModelBackend(SimpleNamespace(model=torch.nn.Linear(4, 3)), ranks)  # type: ignore[arg-type]
    saver = checkpoint.Checkpointer(RunDir(out / "run"), backend, every=1, keep=1, last_step=1)
    t0 = time.monotonic()
    try:
        saver.save(1, policy=None, optimizer=None, scheduler=None, replay=None, config={}, state={})  # type: ignore[arg-type]
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


def push(ranks: Ranks, out: Path) -> dict[str, Any]:
    """A checkpoint of sharded optimizer state, a whole pass over the weights, a failed one."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch.distributed.checkpoint as dcp
    from arpo_lib.serving.weight_sync import full_tensors
    from arpo_lib.training.checkpoint import load_optimizer_shards, save_optimizer_shards

    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    net = torch.nn.Sequential(*(torch.nn.Linear(m.in_features, m.out_features) for m in whole))
    net.load_state_dict(whole.state_dict())
    mesh = init_device_mesh("cpu", (ranks.world_size,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    report: dict[str, Any] = {}

    # a whole pass: rank 0 consumes, rank 1 joins; rank 0 gets the weights `whole` would have
    if ranks.is_main:
        weights = distributed.WeightPass(net, ranks)
        pushed = dict(full_tensors(weights.weights, torch.device("cpu"), [p.dtype for _, p in weights.weights]))
        expected = {f"{i}.{n}": p for i, layer in enumerate(whole) for n, p in layer.named_parameters()}
        report["pass_gap"] = max(float((pushed[k] - v).abs().max()) for k, v in expected.items())
        report["pass_names"] = sorted(pushed) == sorted(expected)
    else:
        distributed.join_full_weights(net, ranks)

    # the optimizer state through torch.distributed.checkpoint, its planning spied on
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net(torch.randn(3, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # as at a resume: DCP's load creates the state only for parameters without grads
    groups = []
    real_save, real_load = dcp.save, dcp.load
    dcp.save = lambda *a, **kw: groups.append(("save", kw.get("process_group"))) or real_save(*a, **kw)
    dcp.load = lambda *a, **kw: groups.append(("load", kw.get("process_group"))) or real_load(*a, **kw)
    save_optimizer_shards(out, net, opt, control=ranks.control)
    again = torch.optim.AdamW(net.parameters(), lr=0.01)
    load_optimizer_shards(out / "optimizer_shards", net, again, control=ranks.control)
    dcp.save, dcp.load = real_save, real_load
    report["dcp_on_control_group"] = [(kind, group is ranks.control and group is not None)
                                      for kind, group in groups]
    saved, loaded = (get_optimizer_state_dict(net, o)["state"] for o in (opt, again))
    report["optimizer_state_gap"] = max(float((loaded[n][k].to_local() - v.to_local()).abs().max())
                                        for n, st in saved.items() for k, v in st.items() if k != "step")
    report["optimizer_state_moved"] = min(float(st["exp_avg"].to_local().abs().max()) for st in saved.values())

    # a pass whose consumer fails at its third tensor: rank 0 stops it (the trainer's close does)
    t0 = time.monotonic()
    try:
        if ranks.is_main:
            weights = distributed.WeightPass(net, ranks)
            try:
                for sent, _ in enumerate(full_tensors(weights.weights, torch.device("cpu"),
                                                      [p.dtype for _, p in weights.weights])):
                    if sent == 2:
                        raise ConnectionError("the server went away (injected)")
            except ConnectionError as exc:
                weights.stop(distributed.describe(exc))
                raise
        else:
            distributed.join_full_weights(net, ranks)
        report["raised"] = None
    except Exception as exc:
        report["raised"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - t0
    return report


class FailingServers:
    """Rank 0's model servers as `RolloutSource` sees them (`ServedWeights`), whose push fails:
    before reading any weight (`at` None: the servers refuse to pause) or at tensor `at`."""

    def __init__(self, weights: Any, at: int | None):
        self._weights, self._at = weights, at
        self.urls = ["http://127.0.0.1:1"]

    def passes_over_weights(self, version: int) -> bool:
        return True

    def policy(self, version: int) -> Any:
        from arpo_lib.serving.weight_sync import full_tensors

        time.sleep(0.5)
        if self._at is None:
            raise ConnectionError("POST /pause: connection refused (injected)")
        weights = self._weights()
        for sent, _ in enumerate(full_tensors(weights, torch.device("cpu"), [p.dtype for _, p in weights])):
            if sent == self._at:
                raise ConnectionError(f"the server went away at tensor {sent} (injected)")
        return None

    def metrics(self) -> dict[str, Any]:
        return {}

    def versioned(self) -> Any:
        return None

    def close(self) -> None:
        pass


def push_through_the_trainers_path(ranks: Ranks, out: Path, at: int | None) -> dict[str, Any]:
    """`RolloutSource.weights_changed` on every rank, the FSDP2 backend keeping only shards."""
    from arpo_lib.serving.weight_sync import FollowingServed
    from arpo_lib.training.backend import FSDP2
    from arpo_lib.training.rollout_source import RolloutSource

    torch.manual_seed(0)
    model = torch.nn.Module()  # the layout shard_for_training looks for: language_model.layers
    model.language_model = torch.nn.Module()
    model.language_model.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])
    model.head = torch.nn.Linear(6, 2)
    policy = SimpleNamespace(model=model, forward_logprobs=lambda *a, **k: None, compute_dtype=torch.float32)
    backend = FSDP2(policy, ranks, keep_full_model=False, micro_batch_size=1, token_budget=0, pack=False)  # type: ignore[arg-type]
    backend.release_full_model()
    served = FailingServers(backend.full_weights, at) if ranks.is_main else FollowingServed(lambda url: None, ranks.rank)
    rollouts = RolloutSource(policy, [], lambda: None, backend, served=served, run=RunDir(out / "run"),  # type: ignore[arg-type]
                             group_size=1, temperature=1.0, top_p=1.0, max_steps=1, format_coef=0.0,
                             format_penalty=0.0, seed=0, progress=False)
    t0 = time.monotonic()
    try:
        rollouts.weights_changed(1)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


def other_rank_fails_mid_pass(ranks: Ranks, out: Path) -> dict[str, Any]:
    """Rank 1's third gather of a pass over the weights fails (its own out-of-memory) while rank 0
    is in that gather: rank 1 closes (3 s) and exits with an error; rank 0 is not released by any
    announcement of ours, only by rank 1's exit (torchrun stops the others; gloo also sees the
    peer gone). Rank 0 records how far it got."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from arpo_lib.serving.weight_sync import full_tensors

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (ranks.world_size,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    t0 = time.monotonic()
    if ranks.is_main:
        weights = distributed.WeightPass(net, ranks)
        for sent, _ in enumerate(full_tensors(weights.weights, torch.device("cpu"), [p.dtype for _, p in weights.weights])):
            (out / "rank0.progress").write_text(str(sent + 1))
        return {"raised": None, "seconds": time.monotonic() - t0}
    real, calls = DTensor.full_tensor, [0]

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, *args, **kwargs)

    DTensor.full_tensor = failing  # type: ignore[method-assign]
    try:
        distributed.join_full_weights(net, ranks)
    except RuntimeError as exc:
        (out / "rank1.json").write_text(json.dumps({"raised": str(exc), "seconds": time.monotonic() - t0}))
        time.sleep(3.0)  # a trainer closing its environments
        sys.exit(1)
    return {"raised": None, "seconds": time.monotonic() - t0}


def main(scenario: str, collective_timeout_s: float, out: str) -> None:
    ranks = Ranks.from_env()
    out_dir = Path(out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout_s))
    ranks = replace(ranks, control=dist.new_group(backend="gloo", timeout=distributed.CONTROL_TIMEOUT))
    if scenario == "other-fails-mid-pass":
        report = other_rank_fails_mid_pass(ranks, out_dir)
    elif scenario == "push":
        report = push(ranks, out_dir)
    elif scenario in ("push-fails-before", "push-fails-mid"):
        report = push_through_the_trainers_path(ranks, out_dir, None if scenario == "push-fails-before" else 2)
    elif scenario == "failed-checkpoint":
        report = failed_checkpoint(ranks, out_dir)
    else:
        report = warm_start_on_rank_0(ranks, out_dir, fail=scenario == "failed-warm-start")
    (out_dir / f"rank{ranks.rank}.json").write_text(json.dumps(report))
    if ranks.is_main and report.get("raised"):  # a trainer closing its environments: rank 0 still alive
        other = out_dir / "rank1.json"
        deadline = time.monotonic() + LINGER_S
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    if report.get("raised"):  # as a failed trainer leaves (Trainer.close(failed=True))
        distributed.abandon_process_group(ranks)
    else:
        distributed.close_process_group(ranks)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
