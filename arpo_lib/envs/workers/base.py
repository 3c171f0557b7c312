"""What every pool of environment workers has (`arpo_lib.types.WorkerPool`): its size, the
workers' restarts, closing as a context manager. The local processes (`envs.pool.EnvPool`) and
the Ray actors (`envs.ray_pool.RayEnvPool`) build on it."""
from __future__ import annotations

from typing import Any


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
