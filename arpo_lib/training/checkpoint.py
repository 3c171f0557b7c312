"""Checkpoints: written atomically, checked before they are trusted, found again on resume.

    checkpoints/step_000004/
        model/               the policy in the Hugging Face layout (merged weights with LoRA, plus adapter.pt)
        optimizer.pt         optimizer and learning-rate schedule
        optimizer_shards/    distributed runs: the optimizer state as torch.distributed.checkpoint
                             files, each process writing its own shard in parallel (optimizer.pt
                             then holds the schedule only)
        replay.json          the replay buffer with its random generator
        trainer_state.json   step, torch RNG, config
        manifest.json        size of every file (a resume detects truncated or missing files)
        .complete            written last: a checkpoint without it never finished

A checkpoint is written into `.tmp_step_N/`, fsynced, then renamed into place, so a crash
leaves the previous checkpoint intact. `resume_point` picks the newest intact one and says why
it skipped any other. `Checkpointer` is the trainer's side: when a checkpoint is due, written by
one process or by every rank of a distributed run, and the one a run resumes from restored.
An optimizer state loads whichever number of processes wrote it (`load_optimizer_state`).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from arpo_lib.algo import ReplayBuffer
from arpo_lib.run import layout
from arpo_lib.run.layout import RunDir
from arpo_lib.run.records import atomic_write_text, fsync_dir, read_jsonl
from arpo_lib.training.distributed import load_full_optimizer_state

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from arpo_lib.training.contracts import TrainablePolicy

log = logging.getLogger(__name__)


def tmp_checkpoint_dir(ckpt_dir: Path, step: int) -> Path:
    """Where step `step`'s checkpoint is written before `save_checkpoint` moves it into place."""
    return ckpt_dir / f".tmp_{layout.step_name(step)}"


def begin_checkpoint(ckpt_dir: Path, step: int) -> Path:
    """The empty `tmp_checkpoint_dir`. Distributed: rank 0 calls this, then every rank writes its
    optimizer shard into it and takes part in writing the model (the backend's `save_policy`: rank
    0 writes), then rank 0 calls `save_checkpoint(..., sharded=True)`."""
    tmp = tmp_checkpoint_dir(ckpt_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def save_optimizer_shards(tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          control: Any = None) -> None:
    """Every rank writes its shard of the optimizer state (FSDP2: DTensors keyed by parameter
    name) into `tmp/optimizer_shards/` with torch.distributed.checkpoint, in parallel: nothing is
    gathered. A collective: all ranks call it. Its planning (pickled plans and metadata, object
    collectives) goes on the gloo control group: on the default group they would run on NCCL,
    through GPU memory and under NCCL's timeout. `control`: that group (`Ranks.control`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=tmp / layout.OPTIMIZER_SHARDS,
             process_group=control)


def load_optimizer_shards(shards: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          control: Any = None) -> None:
    """Read `optimizer_shards/` into `optimizer` (its parameters named as in `model`), re-sharded
    for however many processes load it: each reads only the pieces of its own shard; one
    process (no process group) reads whole tensors. A collective when distributed, planned on the
    gloo control group (as `save_optimizer_shards`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # the layout to fill (creates the state)
    dcp.load(state, checkpoint_id=shards, no_dist=not dist.is_initialized(), process_group=control)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state)


def save_checkpoint(ckpt_dir: Path, step: int, *, policy: "TrainablePolicy", optimizer: torch.optim.Optimizer,
                    scheduler: "LRScheduler", replay: ReplayBuffer, config: dict[str, Any], keep: int,
                    state: dict[str, Any] | None = None, sharded: bool = False) -> Path:
    """Write model, optimizer, scheduler, replay buffer, RNG, step and the trainer's own `state`
    (JSON) atomically; keep the newest `keep` checkpoints. Returns the checkpoint directory.
    `sharded`: the optimizer state is already in the temporary directory's `optimizer_shards/`
    and the model in its `model/` (`begin_checkpoint`, then on every rank `save_optimizer_shards`
    and the backend's `save_policy`)."""
    tmp = tmp_checkpoint_dir(ckpt_dir, step)
    if not sharded:
        begin_checkpoint(ckpt_dir, step)
        policy.save(tmp / layout.MODEL)
    elif not (tmp / layout.OPTIMIZER_SHARDS / ".metadata").is_file():
        raise FileNotFoundError(f"{tmp}: the optimizer shards are missing (save_optimizer_shards first)")
    elif not (tmp / layout.MODEL / "config.json").is_file():
        raise FileNotFoundError(f"{tmp}: the model is missing (the backend's save_policy first)")
    final = ckpt_dir / layout.step_name(step)
    torch.save({"optimizer": None if sharded else optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               tmp / layout.OPTIMIZER)
    replay.save(tmp / layout.REPLAY)
    trainer_state = {"step": step, "torch_rng": torch.get_rng_state().tolist(), "config": config,
                     "time": time.time(), "trainer": state or {}}
    (tmp / layout.TRAINER_STATE).write_text(json.dumps(trainer_state))
    manifest = {}
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            manifest[str(f.relative_to(tmp))] = f.stat().st_size
    # The manifest lets a resume detect a checkpoint damaged after it was written (truncated
    # or missing files) without loading gigabytes; `.complete` marks a finished write.
    (tmp / layout.MANIFEST).write_text(json.dumps(manifest, indent=1))
    (tmp / layout.COMPLETE).write_text("ok\n")
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_dir)
    for old in sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(checkpoint: Path, *, optimizer: torch.optim.Optimizer, scheduler: "LRScheduler",
                    load_optimizer: Callable[[dict[str, Any] | Path], None] | None = None
                    ) -> tuple[int, ReplayBuffer, dict[str, Any]]:
    """Restore optimizer, scheduler and torch's RNG from a checkpoint; returns (step, replay buffer,
    the trainer's own state). The model is loaded by whoever builds the policy (`arpo_lib.build`).
    `load_optimizer(state)` replaces `optimizer.load_state_dict`; it receives the path of the
    `optimizer_shards/` directory when a distributed run wrote the checkpoint."""
    opt = torch.load(checkpoint / layout.OPTIMIZER, weights_only=False)
    if opt["optimizer"] is None:
        if load_optimizer is None:
            raise ValueError(f"{checkpoint}: the optimizer state is sharded; pass load_optimizer")
        load_optimizer(checkpoint / layout.OPTIMIZER_SHARDS)
    else:
        (load_optimizer or optimizer.load_state_dict)(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    replay = ReplayBuffer.load(checkpoint / layout.REPLAY)
    state = json.loads((checkpoint / layout.TRAINER_STATE).read_text())
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    return int(state["step"]), replay, dict(state.get("trainer", {}))


class CheckpointingBackend(Protocol):
    """What a checkpoint asks of the training backend (`training.backend.TrainingBackend`, which
    itself uses this module's savers: this protocol keeps the two modules from importing each other)."""

    sharded_optimizer: bool

    def on_main(self, fn: Callable[[], Any]) -> Any: ...

    def save_optimizer_shards(self, directory: Path, optimizer: torch.optim.Optimizer) -> None: ...

    def save_policy(self, directory: Path) -> None: ...

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Any) -> None: ...


class Checkpointer:
    """A run's checkpoints as the trainer sees them: due every `every` steps and at `last_step`;
    written by one process, or (a sharded optimizer) every rank writing its optimizer shard in
    parallel before rank 0 writes the rest (the full model every rank holds, the schedule, the
    replay buffer) and moves the checkpoint into place; `resume_from` restored at the start."""

    def __init__(self, run: RunDir, backend: "CheckpointingBackend", *, every: int, keep: int, last_step: int,
                 resume_from: Path | None = None):
        self.run, self.backend, self.every, self.keep, self.last_step = run, backend, every, keep, last_step
        self.resume_from = resume_from

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def restore(self, optimizer: torch.optim.Optimizer, scheduler: "LRScheduler"
                ) -> tuple[int, ReplayBuffer, dict[str, Any]] | None:
        """The step, replay buffer and trainer state of `resume_from` (None: a run from step 0);
        the optimizer, schedule and torch's RNG are restored in place."""
        if self.resume_from is None:
            return None
        restored = load_checkpoint(self.resume_from, optimizer=optimizer, scheduler=scheduler,
                                   load_optimizer=lambda state: self.backend.load_optimizer_state(optimizer, state))
        log.info("resumed %s at step %d from %s", self.run.root, restored[0], self.resume_from.name)
        return restored

    def save(self, step: int, *, policy: "TrainablePolicy", optimizer: torch.optim.Optimizer, scheduler: "LRScheduler",
             replay: ReplayBuffer, config: dict[str, Any], state: dict[str, Any]) -> Path:
        """Write step `step`'s checkpoint (all ranks call this together); returns its directory.
        Rank 0's own parts run under `on_main`: when one fails (a full disk) the other ranks
        raise at once with its error instead of waiting at the next collective until it times out."""
        ckpt_dir, backend = self.run.checkpoints, self.backend
        if backend.sharded_optimizer:
            backend.on_main(lambda: begin_checkpoint(ckpt_dir, step))
            backend.save_optimizer_shards(tmp_checkpoint_dir(ckpt_dir, step), optimizer)
            backend.save_policy(tmp_checkpoint_dir(ckpt_dir, step) / layout.MODEL)  # rank 0 writes
        backend.on_main(lambda: save_checkpoint(
            ckpt_dir, step, policy=policy, optimizer=optimizer, scheduler=scheduler, replay=replay, config=config,
            keep=self.keep, sharded=backend.sharded_optimizer, state=state))
        return ckpt_dir / layout.step_name(step)


# -- optimizer states written by another number of processes -------------------------------------
def load_optimizer_state(state: dict[str, Any] | Path, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         sharded: torch.nn.Module | None, control: Any = None) -> None:
    """Load a checkpoint's optimizer state into `optimizer` (of `model`'s trainable parameters,
    or of their FSDP2 shards in `sharded`), whichever number of processes wrote it: by position
    (one process), by parameter name (gathered from FSDP shards by earlier versions), or the
    directory of torch.distributed.checkpoint shards a distributed run writes (re-sharded for
    this number of processes)."""
    if isinstance(state, Path):
        load_optimizer_shards(state, sharded if sharded is not None else _named_as_sharded(model), optimizer, control)
        return
    names = [f"net.{n}" for n, p in model.named_parameters() if p.requires_grad]
    by_name = any(isinstance(k, str) for k in state["state"]) or any(
        isinstance(p, str) for g in state["param_groups"] for p in g["params"])
    if sharded is not None:
        load_full_optimizer_state(sharded, optimizer, state if by_name else optimizer_state_by_name(state, names))
    else:
        optimizer.load_state_dict(optimizer_state_by_position(state, names) if by_name else state)


def _named_as_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under the name the sharded copy gives it (`net.`), so one process can read the
    optimizer shards a distributed run wrote (same parameter names)."""
    holder = torch.nn.Module()
    holder.net = model
    return holder


def optimizer_state_by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A one-process `optimizer.state_dict()` (parameters by position in `names`, the trainable
    parameters' names in order) in the by-name form torch.distributed's state-dict helpers use."""
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_position(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_name`: a by-name state for one process."""
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"the checkpoint's optimizer holds state of parameters this model lacks: {unknown[:3]}")
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


# -- finding a checkpoint to resume from ---------------------------------------------------------
def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint with its `.complete` marker; partial ones are skipped."""
    if not ckpt_dir.is_dir():
        return None
    complete = [p for p in ckpt_dir.glob("step_*") if (p / layout.COMPLETE).is_file()]
    return max(complete, key=lambda p: p.name) if complete else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None when it looks intact): unfinished, files
    missing or of the wrong size, unreadable state or replay buffer."""
    if not (checkpoint / layout.COMPLETE).is_file():
        return "unfinished (no .complete marker)"
    try:
        manifest = json.loads((checkpoint / layout.MANIFEST).read_text())
        for name, size in manifest.items():
            path = checkpoint / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, expected {size}"
        json.loads((checkpoint / layout.TRAINER_STATE).read_text())
        ReplayBuffer.load(checkpoint / layout.REPLAY)
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    return None


def usable_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that is complete and intact; damaged ones are reported and skipped."""
    if not ckpt_dir.is_dir():
        return None
    for checkpoint in sorted((p for p in ckpt_dir.glob("step_*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        log.warning("skipping checkpoint %s: %s", checkpoint.name, problem)
    return None


def resume_point(run: RunDir, resume: bool) -> Path | None:
    """The checkpoint a run continues from (None: step 0). Without `resume` a directory that
    already holds a run is refused, so nothing is overwritten by accident."""
    if not resume:
        if run.metrics.exists():
            raise FileExistsError(f"{run.root} already holds a run: resume it or choose another name")
        return None
    checkpoint = usable_checkpoint(run.checkpoints)
    if checkpoint is None and run.metrics.exists():
        log.info("no complete checkpoint in %s; starting from step 0", run.checkpoints)
    return checkpoint


def drop_records_after(run: RunDir, step: int) -> None:
    """Metric lines written after the checkpoint a run resumes from belong to steps that will be
    redone: drop them, so no step is logged twice. Starting over from step 0 redoes the warm
    start too, so its record goes as well."""
    if step == 0:
        run.warm_start_log.unlink(missing_ok=True)
    if not run.metrics.exists():
        return
    kept = [m for m in read_jsonl(run.metrics) if m.get("step", 0) <= step]
    atomic_write_text(run.metrics, "".join(json.dumps(m) + "\n" for m in kept))


def load_model_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint's model, for a policy object that was built elsewhere."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).state_dict()
