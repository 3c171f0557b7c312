"""What every pool of environment workers has (`arpo_lib.types.WorkerPool`): its size, the
workers' restarts, closing as a context manager. The local processes (`envs.pool.EnvPool`) and
the Ray actors (`envs.ray_pool.RayEnvPool`) build on it."""
from __future__ import annotations

from typing import Any

NODE_LOST = "environment node lost"
"""How a Ray pool's message for an episode whose actor's node left the cluster begins."""

FAILURE_CAUSES: tuple[tuple[str, str], ...] = (
    (NODE_LOST, "node_lost"),
    ("environment worker actor died", "actor_died"),
    ("environment actor unreachable", "actor_died"),
    ("environment actor call failed", "actor_died"),
    ("environment actor call timed out", "timeout"),
    ("environment call timed out", "timeout"),
    ("worker process died", "worker_died"),
    ("worker connection lost", "worker_died"),
    ("worker pipe broken", "worker_died"),
)
"""How the pools' messages for an episode lost to the infrastructure begin (the engine stores the
message as the episode's `error`), and the cause each names. Anything else an environment raised
itself (a browser or desktop that broke, a crashed application): `environment`."""


def failure_cause(error: str | None) -> str:
    """The cause of an infrastructure failure (`FAILURE_CAUSES`) from the message it was stored with."""
    text = (error or "").lstrip()
    return next((cause for prefix, cause in FAILURE_CAUSES if text.startswith(prefix)), "environment")


class PoolBase:
    """`workers` is the list the rollout engine sends commands to; `close` ends them all."""

    workers: list[Any]

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
