"""Environment workers as Ray actors: one actor per environment, placed by cluster resources.

As in ARPO, environments are Ray actors placed by a custom per-node resource, so the VMs land
on the CPU nodes meant for them and the trainer keeps its GPU node. Here each environment is an
actor that holds ONE local `EnvWorker` (a process on the actor's node, in the `python=`
interpreter when given) and forwards the engine's commands to it. So browser/VM process hygiene,
the per-call timeout and worker restarts stay in `worker.py`, for both backends; this side adds
what only a cluster has:

- placement: an actor asks for `num_cpus` and, with `resource="env_slot"`, one unit of that
  custom resource, so only nodes started with `--resources '{"env_slot": 8}'` host
  environments (8 each). Placement is checked at construction with a bounded wait: a resource no
  node has is an `EnvSetupError` naming what the cluster offers, not a hang;
- an outer timeout (the worker's timeout + `call_margin_s`, which covers its own restart): an
  actor that does not answer is killed and recreated;
- actor death (killed, crashed, its node lost) is an `EnvError` for the episode, and the actor is
  recreated, exactly as a dead worker process is on the local backend.

The actor starts its worker as `python -m arpo_lib.envs.workers.worker` (EnvWorker's
`fresh_interpreter`): a multiprocessing spawn child would re-import the actor's main module,
which is Ray's worker script (+65 MB and a Ray import in every environment process).

The pool has the interface the rollout engine uses: `.workers[i].send/recv/call/restart/close`,
`len()`, `.restarts`, `.close()`, context manager. Ray is imported when a pool is built.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any

from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.base import PoolBase
from arpo_lib.envs.workers.worker import DEFAULT_MEMORY_MIB, EnvSetupError, EnvWorker, answer, check_memory_mib
from arpo_lib.run.registry import plugin_path

DEFAULT_NUM_CPUS = 0.5
"""CPUs an environment actor reserves. The actor itself only forwards calls; the browser or VM
client beside it does the work. Below 1 so a 2-core laptop's local Ray fits 4 environments;
on a cluster, a custom `resource` is what should limit environments per node."""


class _EnvActor:
    """Lives in a Ray worker process on some node: one local EnvWorker, calls forwarded to it.

    Every answer is (status, value, worker restarts): errors travel as values, so the driver
    maps them exactly as EnvWorker does instead of unwrapping Ray's task errors."""

    def __init__(self, env_options: dict[str, Any], timeout_s: float, cache_size: int, python: str | None,
                 plugins: Sequence[str] = (), plugin_dirs: Sequence[str] = (),
                 memory_mib: int | None = DEFAULT_MEMORY_MIB):
        self.worker: EnvWorker | None = None
        self.setup_error: str | None = None
        # The driver's plug-in directories, so that the worker finds the plug-ins (same image on every node).
        sys.path[:0] = [d for d in plugin_dirs if d not in sys.path]
        try:
            self.worker = EnvWorker(env_options, timeout_s, cache_size, python=python, fresh_interpreter=True,
                                    plugins=plugins, memory_mib=memory_mib)
        except EnvSetupError as exc:  # told to the driver by ping, in EnvWorker's words
            self.setup_error = str(exc)

    def ping(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "hostname": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "worker_pid": self.worker.process.pid if self.worker else None, "setup_error": self.setup_error}

    def call(self, cmd: str, payload: Any) -> tuple[str, Any, int]:
        if self.worker is None:
            return "fatal", self.setup_error, 0
        try:
            return "ok", self.worker.call(cmd, payload), self.worker.restarts
        except EnvSetupError as exc:
            return "fatal", str(exc), self.worker.restarts
        except EnvError as exc:
            return "env_error", str(exc), self.worker.restarts

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(max_restarts=0)(_EnvActor)


class RayEnvWorker:
    """The driver's handle on one environment actor (the same methods as EnvWorker)."""

    def __init__(self, pool: RayEnvPool, index: int):
        self.pool = pool
        self.index = index
        self.timeout_s = pool.timeout_s
        self._actor_restarts = 0
        self._inner_restarts_before = 0  # restarts done inside actors that are gone
        self._inner_restarts = 0  # ... and inside the current one
        self._ref: Any = None
        self.busy = False
        self.actor = self._create()

    @property
    def restarts(self) -> int:
        """Worker restarts inside the actors plus actors recreated."""
        return self._actor_restarts + self._inner_restarts_before + self._inner_restarts

    def _create(self) -> Any:
        p = self.pool
        return _actor_class().options(**p.actor_options).remote(p.env_options, p.timeout_s, p.cache_size, p.python,
                                                                p.plugins, p.plugin_dirs, p.memory_mib)

    def send(self, cmd: str, payload: Any = None) -> None:
        import ray

        try:
            self._ref = self.actor.call.remote(cmd, payload)
            self.busy = True
        except ray.exceptions.RayError as exc:
            self.restart()
            raise EnvError(f"environment actor unreachable: {exc}") from exc

    def ready(self) -> bool:
        """The last command's answer is in (or there is none): `recv` does not block."""
        import ray

        if self._ref is None:
            return True
        done, _ = ray.wait([self._ref], timeout=0)
        return bool(done)

    def recv(self) -> Any:
        """The answer to the last command; raises EnvError (after recreating the actor) when the
        actor died or did not answer in time, EnvError/EnvSetupError as EnvWorker for the rest."""
        import ray

        ref, self._ref, self.busy = self._ref, None, False
        if ref is None:
            raise EnvError("recv without a command in flight")
        limit = self.timeout_s + self.pool.call_margin_s
        try:
            status, value, self._inner_restarts = ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError as exc:
            self.restart()
            raise EnvError(f"environment actor call timed out after {limit:.0f} s") from exc
        except ray.exceptions.RayActorError as exc:
            self.restart()
            raise EnvError(f"environment worker actor died: {_first_line(exc)}") from exc
        except ray.exceptions.RayError as exc:  # lost object, unpicklable answer, node failure
            self.restart()
            raise EnvError(f"environment actor call failed: {_first_line(exc)}") from exc
        return answer(status, value)

    def call(self, cmd: str, payload: Any = None) -> Any:
        self.send(cmd, payload)
        return self.recv()

    def ping(self) -> dict[str, Any]:
        """The actor's pid, hostname, node id and its worker's pid (bounded by the placement timeout)."""
        import ray

        return ray.get(self.actor.ping.remote(), timeout=self.pool.placement_timeout_s)

    def restart(self) -> None:
        """Kill the actor (its worker follows: see worker._exit_with_parent) and place a new one."""
        self._actor_restarts += 1
        self._inner_restarts_before += self._inner_restarts
        self._inner_restarts = 0
        self.kill()
        self.actor = self._create()
        self.pool._wait_placed([self])

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:
            pass
        self.kill()


class RayEnvPool(PoolBase):
    """`n` environment actors sharing the same make_env options.

    `address`: None starts a private local Ray (shut down again by `close`); "auto" or
    "ray://head:10001" joins a cluster, whose nodes must have arpo_lib importable (the same image,
    or `init_kwargs={"runtime_env": {...}}`). When Ray is already initialised, the pool uses it as
    it is. `resource`: a custom resource each actor takes one unit of; `num_cpus`: what each
    reserves. `python`: the workers' interpreter on their nodes, `plugins` the modules they import
    (see EnvWorker; the nodes must have them at the driver's paths, as arpo_lib).
    `placement_timeout_s` bounds the wait for the actors to be placed and started;
    `call_margin_s` is what an actor call may take beyond the worker's own timeout.

    A Ray started here is quiet (`log_to_driver=False`, no dashboard, a 200 MB object store):
    actors' and workers' output is in Ray's session logs (/tmp/ray/session_latest/logs).
    """

    def __init__(self, n: int, env_options: dict[str, Any] | None = None, timeout_s: float = 120.0,
                 cache_size: int = 1, *, address: str | None = None, resource: str | None = None,
                 python: str | None = None, num_cpus: float = DEFAULT_NUM_CPUS,
                 placement_timeout_s: float = 60.0, call_margin_s: float = 30.0,
                 init_kwargs: dict[str, Any] | None = None, plugins: Sequence[str] = (),
                 memory_mib: int | None = DEFAULT_MEMORY_MIB):
        if n < 1:
            raise ValueError(f"a pool needs at least one environment, got n={n}")
        if num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
        self.env_options = dict(env_options or {})
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.python = python
        self.plugins = list(plugins)
        self.plugin_dirs = plugin_path(self.plugins)
        self.memory_mib = check_memory_mib(memory_mib)
        self.resource = resource
        self.placement_timeout_s = placement_timeout_s
        self.call_margin_s = call_margin_s
        self.actor_options: dict[str, Any] = {"num_cpus": num_cpus}
        if resource:
            self.actor_options["resources"] = {resource: 1}
        self.started_ray = _ensure_ray(address, init_kwargs)
        self.workers: list[RayEnvWorker] = []
        try:
            self.workers = [RayEnvWorker(self, i) for i in range(n)]
            self._wait_placed(self.workers)
        except BaseException:
            self.close()
            raise

    def _wait_placed(self, workers: list[RayEnvWorker]) -> None:
        """Block until these actors run (their constructors done), at most placement_timeout_s."""
        import ray

        try:
            facts = ray.get([w.actor.ping.remote() for w in workers], timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for w in workers:
                w.kill()
            raise EnvSetupError(
                f"environment actors were not placed within {self.placement_timeout_s:.0f} s: each asks for "
                f"{self.actor_options}, the cluster has {_rounded(ray.cluster_resources())}, free now: "
                f"{_rounded(ray.available_resources())}"
                + (f". Start the environment nodes with --resources '{{\"{self.resource}\": N}}'."
                   if self.resource else "")) from None
        except ray.exceptions.RayActorError as exc:  # arpo_lib missing on the node, say
            for w in workers:
                w.kill()
            raise EnvSetupError(f"an environment actor could not start: {_plain(exc)}") from None
        errors = [f["setup_error"] for f in facts if f["setup_error"]]
        if errors:
            for w in workers:
                w.kill()
            raise EnvSetupError(f"an environment actor could not start its worker: {errors[0]}")

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        closing = [w.actor.close.remote() for w in self.workers]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        except Exception:
            pass
        for w in self.workers:
            w.kill()
        self.workers = []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def _ensure_ray(address: str | None, init_kwargs: dict[str, Any] | None) -> bool:
    """Initialise Ray unless it is; True when this call started it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the Ray environment backend needs ray: pip install 'arpo-workbench[distributed]'") from exc
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address is None:
        # "local", not None: None would join whatever cluster RAY_ADDRESS or /tmp/ray points at.
        kwargs.update(address="local", num_cpus=os.cpu_count(), object_store_memory=200 * 2**20,
                      include_dashboard=False)
    else:
        kwargs["address"] = address
    kwargs.update(init_kwargs or {})
    ray.init(**kwargs)
    return True


def _rounded(resources: dict[str, float]) -> dict[str, float]:
    """Only what placement looks at (Ray also lists memory and per-node bookkeeping keys)."""
    return {k: round(v, 2) for k, v in sorted(resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _plain(exc: BaseException) -> str:
    """Ray's message without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()


def _first_line(exc: BaseException) -> str:
    text = _plain(exc)
    return text.splitlines()[0] if text else type(exc).__name__
