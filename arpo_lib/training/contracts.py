"""The trainer's contracts: what training asks of the policy it updates (`TrainablePolicy`) and of
the servers that follow its weights (`ServedWeights`, `FollowingWeights`), and what a notebook asks
of a trainer (`RunTrainer`). Data between packages is `arpo_lib.types`; these are training's own.
Torch, transformers and the layers above appear in annotations only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from arpo_lib.types import Policy, Segment

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable, ContextManager

    import torch
    from transformers import ProcessorMixin

    from arpo_lib.algo import ReplayBuffer
    from arpo_lib.run.config import RunConfig
    from arpo_lib.run.layout import RunDir


class PushLock(Protocol):
    """Requests against weight pushes (`serving.weight_sync.VersionLock`): `push()` waits for the
    requests in flight, holds new ones back while it is held, and nests on one thread."""

    def push(self) -> "ContextManager[None]": ...


@runtime_checkable
class TrainablePolicy(Policy, Protocol):
    """A policy the trainer updates (`HFPolicy`): it acts in rollouts (`Policy`) and exposes its
    model and the training forward."""

    model: "torch.nn.Module"
    """The whole model: generation, the old log-probs, what a checkpoint saves. In a distributed
    run with model servers it is on the meta device once training starts (the weights live in the
    FSDP2 shards only: `training.backend.FSDP2`, keep_full_model=False)."""
    processor: "ProcessorMixin"
    """Tokenizer and image processor (a replayed trajectory's tokens are reloaded with it)."""
    compute_dtype: "torch.dtype"
    device: "torch.device"
    path: "str | Path"
    """Where the model was loaded from (what a server without weight sync serves)."""

    def trainable_parameters(self) -> list["torch.nn.Parameter"]:
        """What the optimizer updates: all weights, or only the LoRA adapters."""
        ...

    def sequence_logprobs(self, segments: Sequence["Segment"], temperature: float = 1.0, pack: bool = False,
                          model: "torch.nn.Module | None" = None) -> list["torch.Tensor"]:
        """Log-probs (with grad) of every loss-masked token of each segment, (n_i,) each; `model`:
        another network of the same architecture (the KL reference, the FSDP2-sharded copy)."""
        ...

    def forward_logprobs(self, model: "torch.nn.Module", batch: dict[str, "torch.Tensor"], targets: "torch.Tensor",
                         temperature: float) -> "torch.Tensor":
        """The training forward of `model` over a padded or packed batch: the `targets` tokens'
        log-probs, (N,) (what the sharded copy runs)."""
        ...

    def save(self, directory: "str | Path", state_dict: "dict[str, torch.Tensor] | None" = None) -> None:
        """The weights (its own, or `state_dict`'s) and processor in the Hugging Face layout."""
        ...


@runtime_checkable
class ServedWeights(Protocol):
    """Model servers generating a trainer's rollouts on its weights (`serving.weight_sync`:
    `ServedPolicy`, which starts or connects to them and pushes each new weight version)."""

    @property
    def urls(self) -> list[str] | None:
        """The servers' base URLs (None before the first `policy`)."""
        ...

    def policy(self, version: int) -> Policy:
        """The servers' client policy, the servers holding the trainer's weight version `version`."""
        ...

    def passes_over_weights(self, version: int) -> bool:
        """Whether `policy(version)` reads the trainer's weights (rank 0's; a follower: False)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Counters for the step's metrics (requests, prompt mismatches, time spent syncing)."""
        ...

    def versioned(self) -> Policy:
        """The client, each response marked with the weight version that produced it (the batches
        played ahead of the update: rollout.max_staleness)."""
        ...

    @property
    def version_lock(self) -> "PushLock":
        """Held by each request of `versioned()` and by each push: no response straddles one."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class FollowingWeights(ServedWeights, Protocol):
    """The servers of a distributed run seen from a rank other than 0 (`FollowingServed`): rank 0
    keeps them current and announces their URLs; this rank follows."""

    def follow(self, urls: Sequence[str]) -> Policy:
        """The client of the servers at `urls` (rank 0's announcement)."""
        ...

    def learned(self, version: int, urls: Sequence[str] | None) -> None:
        """Rank 0's servers (at `urls`) now hold weight version `version` (what this rank's
        `versioned()` responses record from now on)."""
        ...


@runtime_checkable
class RunTrainer(Protocol):
    """What a notebook holds to train a run (`workflows.open_trainer`): `training.trainer.Trainer`
    in this process, or `training.launch.LaunchedTrainer` (torchrun's processes, watched from here)."""

    cfg: "RunConfig"
    run: "RunDir"
    run_dir: "Path"

    @property
    def step(self) -> int:
        """Rollout batches done."""
        ...

    @property
    def replay(self) -> "ReplayBuffer":
        """The replay buffer (a launched run's: its newest checkpoint's)."""
        ...

    def train(self, *, on_step: "Callable[[dict[str, Any]], None] | None" = None) -> list[dict[str, Any]]:
        """Train to `train.steps` (resuming where the run is); `on_step(metrics)` after each step."""
        ...

    def warm_start(self) -> list[float]:
        """The supervised warm start's losses (none where it is done elsewhere or already)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> "RunTrainer": ...

    def __exit__(self, *exc: object) -> None: ...
