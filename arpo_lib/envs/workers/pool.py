"""Pools of environment workers, as the rollout engine uses them (`arpo_lib.types.WorkerPool`).

`make_pool` picks the backend: local worker processes (`EnvPool`, this module) or one Ray actor
per environment on any node of a cluster (`arpo_lib.envs.workers.ray_pool.RayEnvPool`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arpo_lib.envs.workers.base import PoolBase
from arpo_lib.envs.workers.worker import DEFAULT_MEMORY_MIB, EnvWorker

if TYPE_CHECKING:
    from arpo_lib.envs.workers.ray_pool import RayEnvPool


class EnvPool(PoolBase):
    """`n` worker processes sharing the same make_env options (and interpreter, plug-ins and memory
    limit, see EnvWorker)."""

    def __init__(self, n: int, env_options: dict[str, Any] | None = None, timeout_s: float = 120.0,
                 cache_size: int = 1, *, python: str | None = None, plugins: Sequence[str] = (),
                 memory_mib: int | None = DEFAULT_MEMORY_MIB):
        self.workers: list[EnvWorker] = []
        try:
            for _ in range(n):
                self.workers.append(EnvWorker(dict(env_options or {}), timeout_s, cache_size, python=python,
                                              plugins=plugins, memory_mib=memory_mib))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for w in self.workers:
            w.close()


def make_pool(n: int, env_options: dict[str, Any] | None = None, timeout_s: float = 120.0, cache_size: int = 1, *,
              backend: str = "local", python: str | None = None, plugins: Sequence[str] = (),
              ray_address: str | None = None, ray_resource: str | None = None,
              ray_num_cpus: float | None = None, memory_mib: int | None = DEFAULT_MEMORY_MIB) -> EnvPool | RayEnvPool:
    """The environment pool a run's config asks for.

    backend="local": worker processes on this machine (`EnvPool`); "ray": one Ray actor per
    environment (`RayEnvPool`), placed on nodes that advertise `ray_resource` when given, on the
    cluster at `ray_address` ("auto", "ray://host:10001") or a private local Ray when None.
    `python` is the workers' interpreter in both, `plugins` the modules they import, `memory_mib`
    each worker's data memory limit (see EnvWorker).
    """
    if backend == "local":
        given = [k for k, v in (("ray_address", ray_address), ("ray_resource", ray_resource),
                                ("ray_num_cpus", ray_num_cpus)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to backend='ray' (backend is 'local')")
        return EnvPool(n, env_options, timeout_s, cache_size, python=python, plugins=plugins, memory_mib=memory_mib)
    if backend == "ray":
        from arpo_lib.envs.workers.ray_pool import RayEnvPool

        extra = {} if ray_num_cpus is None else {"num_cpus": ray_num_cpus}
        return RayEnvPool(n, env_options, timeout_s, cache_size, address=ray_address, resource=ray_resource,
                          python=python, plugins=plugins, memory_mib=memory_mib, **extra)
    raise ValueError(f"unknown environment backend {backend!r}: use 'local' or 'ray'")
