"""Environment workers as Ray actors: one actor per environment, placed by cluster resources.

As in ARPO, environments are Ray actors placed by a custom per-node resource, so the VMs land
on the CPU nodes meant for them and the trainer keeps its GPU node. Here each environment is an
actor that holds ONE local `EnvWorker` (a process on the actor's node, in the `python=`
interpreter when given) and forwards the engine's commands to it. So browser/VM process hygiene,
the per-call timeout and worker restarts stay in `worker.py`, for both backends; this side adds
what only a cluster has:

- placement: an actor asks for `num_cpus` and, with `resource="env_slot"`, one unit of that
  custom resource, so only nodes started with `--resources '{"env_slot": 8}'` host
  environments (8 each), spread over those nodes (Ray's SPREAD strategy: a node lost takes as
  few episodes as it can). Placement is checked with a bounded wait, at construction and at every
  replacement: a resource no node has (or no longer has: every environment node lost) is an
  `EnvSetupError` naming what the cluster offers, not a hang;
- an outer timeout (the worker's timeout + `call_margin_s`, which covers its own restart): an
  actor that does not answer is killed and recreated;
- actor death is an `EnvError` for the episode, and the actor is recreated on a node that still
  offers the resource, exactly as a dead worker process is on the local backend. The message
  says which: its node left the cluster (`NODE_LOST`) or the actor alone died;
- a node that joins (or comes back) takes environments at their next reset: an actor on a node
  holding more than its share of the pool moves to a node holding less than its share, between
  two episodes, never during one.

The actor starts its worker as `python -m arpo_lib.envs.workers.worker` (EnvWorker's
`fresh_interpreter`): a multiprocessing spawn child would re-import the actor's main module,
which is Ray's worker script (+65 MB and a Ray import in every environment process).

The pool has the interface the rollout engine uses: `.workers[i].send/recv/call/restart/close`,
`len()`, `.restarts`, `.close()`, context manager. Ray is imported when a pool is built.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.base import NODE_LOST, PoolBase
from arpo_lib.envs.workers.worker import DEFAULT_MEMORY_MIB, EnvSetupError, EnvWorker, answer, check_memory_mib
from arpo_lib.run.registry import plugin_path

DEFAULT_NUM_CPUS = 0.5
"""CPUs an environment actor reserves. The actor itself only forwards calls; the browser or VM
client beside it does the work. Below 1 so a 2-core laptop's local Ray fits 4 environments;
on a cluster, a custom `resource` is what should limit environments per node."""
NODES_CHECK_S = 2.0
"""A pool looks at the cluster's nodes (for one that joined) at most this often, at a reset."""


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
        self.moves = 0
        """Times the actor moved to a node that joined (between two episodes; not restarts)."""
        self.node_id: str | None = None
        """The node the actor runs on (known once placed)."""
        self.actor = self._create()

    @property
    def restarts(self) -> int:
        """Worker restarts inside the actors plus actors recreated."""
        return self._actor_restarts + self._inner_restarts_before + self._inner_restarts

    def _create(self, node_id: str | None = None) -> Any:
        """A new actor, on `node_id` when it has room there now (else wherever the pool's options
        place it)."""
        p = self.pool
        options = dict(p.actor_options)
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True,
                                                                            _spill_on_unavailable=True)
        self.node_id = None
        return _actor_class().options(**options).remote(p.env_options, p.timeout_s, p.cache_size, p.python,
                                                        p.plugins, p.plugin_dirs, p.memory_mib)

    def send(self, cmd: str, payload: Any = None) -> None:
        import ray

        if cmd == "reset":  # between two episodes: the moment to move to a node that joined
            target = self.pool.nodes.wanting(self)
            if target is not None:
                self._replace(target, graceful=True)
                self.moves += 1
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
        actor died, its node left or it did not answer in time, EnvError/EnvSetupError as
        EnvWorker for the rest."""
        import ray

        ref, self._ref, self.busy = self._ref, None, False
        if ref is None:
            raise EnvError("recv without a command in flight")
        limit = self.timeout_s + self.pool.call_margin_s
        try:
            status, value, self._inner_restarts = ray.get(ref, timeout=limit)
        except ray.exceptions.RayError as exc:
            raise self._lost(exc, limit) from exc
        return answer(status, value)

    def _lost(self, exc: BaseException, limit: float) -> EnvError:
        """The episode's EnvError for a call the actor never answered, once the actor is replaced:
        its node left the cluster (`NODE_LOST`), or the actor died, hung or failed on its own."""
        import ray

        if isinstance(exc, ray.exceptions.GetTimeoutError):
            why = f"environment actor call timed out after {limit:.0f} s"
        elif isinstance(exc, ray.exceptions.RayActorError):
            why = f"environment worker actor died: {_first_line(exc)}"
        else:  # lost object, unpicklable answer
            why = f"environment actor call failed: {_first_line(exc)}"
        node = self.node_id
        node_lost = self.pool.nodes.lost(node)
        self.restart()
        if node_lost:
            return EnvError(f"{NODE_LOST}: node {node} left the cluster during this episode ({why})")
        return EnvError(why)

    def call(self, cmd: str, payload: Any = None) -> Any:
        self.send(cmd, payload)
        return self.recv()

    def ping(self) -> dict[str, Any]:
        """The actor's pid, hostname, node id and its worker's pid (bounded by the placement timeout)."""
        import ray

        return ray.get(self.actor.ping.remote(), timeout=self.pool.placement_timeout_s)

    def restart(self) -> None:
        """Kill the actor (its worker follows: see worker._exit_with_parent) and place a new one on
        a node that offers the resource (EnvSetupError when none does within the placement wait)."""
        self._actor_restarts += 1
        self._replace(self.pool.nodes.emptiest(self.pool.workers))

    def _replace(self, node_id: str | None = None, graceful: bool = False) -> None:
        """A new actor for this worker (on `node_id` if given); `graceful`: the old one closes its
        environments first (an idle actor that moves) instead of being killed outright."""
        self._inner_restarts_before += self._inner_restarts
        self._inner_restarts = 0
        if graceful:
            self.close()
        else:
            self.kill()
        self.actor = self._create(node_id)
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


class ClusterNodes:
    """What a pool knows of the nodes that offer its resource: which do now (as Ray lists them,
    looked up at most every NODES_CHECK_S), which it saw, and which it found gone. Ray's control
    store notices a node's death only after its health checks fail (~15 s): a node whose raylet
    refuses a connection (or does not answer within `probe_timeout_s`) is taken for lost at once,
    so that no replacement goes there and its episodes are counted as lost with it."""

    def __init__(self, resource: str | None, balance: bool = True, probe_timeout_s: float = 2.0):
        self.resource = resource
        self.balance = balance
        """Replacements and moves follow each node's share (`emptiest`, `wanting`); False: Ray places."""
        self.probe_timeout_s = probe_timeout_s
        self.seen: set[str] = set()
        """Every node that hosted one of the pool's actors."""
        self.gone: set[str] = set()
        """Nodes found lost (their raylet does not answer, or Ray says they died)."""
        self._offered: dict[str, float] = {}  # node -> the resource it offers, as last looked up
        self._looked_at = -math.inf

    def offering(self, refresh: bool = False) -> dict[str, float]:
        """The live nodes that offer the resource -> how much each offers."""
        import ray

        now = time.monotonic()
        if refresh or now - self._looked_at >= NODES_CHECK_S:
            listed = ray.nodes()
            self.gone |= {n["NodeID"] for n in listed if not n["Alive"] and n["NodeID"] in self.seen}
            self._offered = {n["NodeID"]: n["Resources"].get(self.resource, 0.0) for n in listed
                             if n["Alive"] and n["Resources"].get(self.resource, 0.0) > 0}
            self._looked_at = now
        return {node: slots for node, slots in self._offered.items() if node not in self.gone}

    def lost(self, node_id: str | None) -> bool:
        """Whether `node_id` has left the cluster: Ray says so, or its raylet does not answer."""
        import ray

        if node_id is None:
            return False
        if node_id in self.gone:
            return True
        try:
            entry = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        except Exception:  # the head itself unreachable: say nothing of the node
            return False
        if entry is None or not entry["Alive"] or not _answers(entry["NodeManagerAddress"], entry["NodeManagerPort"],
                                                                 self.probe_timeout_s):
            self.gone.add(node_id)
            return True
        return False

    def shares(self, workers: Sequence[RayEnvWorker]) -> tuple[dict[str, float], Counter, dict[str, float]]:
        """(slots offered per live node, the workers placed on each, each node's share of the
        workers: proportional to its slots)."""
        slots = self.offering() if self.resource and self.balance else {}
        placed = Counter(w.node_id for w in workers if w.node_id in slots)
        total = sum(slots.values())
        return slots, placed, {node: len(workers) * offered / total for node, offered in slots.items()}

    def emptiest(self, workers: Sequence[RayEnvWorker]) -> str | None:
        """The live node furthest below its share of the workers that has a slot they do not use
        (where a replacement goes); None: leave it to Ray (no resource, or no such node)."""
        slots, placed, share = self.shares(workers)
        room = {node: share[node] - placed[node] for node in slots if placed[node] < slots[node]}
        # (Ray may list a node that just went for a while yet: the probe tells)
        return next((node for node in sorted(room, key=room.get, reverse=True) if not self.lost(node)), None)

    def wanting(self, worker: RayEnvWorker) -> str | None:
        """Where `worker` should move before its next episode, or None: when its node holds more of
        the pool's workers than its share (rounded up), the node furthest below its share (rounded
        down) with a slot they do not use. Other pools' actors are not counted."""
        if worker.node_id is None:
            return None
        slots, placed, share = self.shares(worker.pool.workers)
        if worker.node_id not in slots or placed[worker.node_id] <= math.ceil(share[worker.node_id]):
            return None
        short = {node: share[node] - placed[node] for node in slots
                 if placed[node] < math.floor(share[node]) and placed[node] < slots[node]}
        return next((node for node in sorted(short, key=short.get, reverse=True) if not self.lost(node)), None)

    def advice(self) -> str:
        """What to do about actors that could not be placed: the nodes lost, or the resource to offer."""
        if not self.resource:
            return ""
        offering = [node for node in self.offering(refresh=True) if not self.lost(node)]
        lost = sorted(self.seen - set(offering))
        if not offering and lost:
            return (f". No node offers {self.resource} any more: the environment node(s) {', '.join(lost)} left "
                    "the cluster. Start environment nodes again (scripts/ray_env_node.sh HEAD:PORT) and resume the run")
        if lost:
            return (f". Node(s) {', '.join(lost)} left the cluster and the nodes left have no free {self.resource}: "
                    "start another environment node, or give the nodes spare slots")
        return f". Start the environment nodes with --resources '{{\"{self.resource}\": N}}'."


class RayEnvPool(PoolBase):
    """`n` environment actors sharing the same make_env options.

    `address`: None starts a private local Ray (shut down again by `close`); "auto" or
    "ray://head:10001" joins a cluster, whose nodes must have arpo_lib importable (the same image,
    or `init_kwargs={"runtime_env": {...}}`). When Ray is already initialised, the pool uses it as
    it is. `resource`: a custom resource each actor takes one unit of; `num_cpus`: what each
    reserves. `python`: the workers' interpreter on their nodes, `plugins` the modules they import
    (see EnvWorker; the nodes must have them at the driver's paths, as arpo_lib).
    `placement_timeout_s` bounds the wait for the actors to be placed and started;
    `call_margin_s` is what an actor call may take beyond the worker's own timeout. `spread`:
    place the actors over as many nodes as offer room (Ray's SPREAD; with a `resource`, a
    replacement goes to the node furthest below its share, and an actor moves at its next reset
    from a node holding more than its share to one holding less: a node that joined or came
    back); False leaves placement to Ray's default (packing).

    A Ray started here is quiet (`log_to_driver=False`, no dashboard, a 200 MB object store):
    actors' and workers' output is in Ray's session logs (/tmp/ray/session_latest/logs).
    """

    def __init__(self, n: int, env_options: dict[str, Any] | None = None, timeout_s: float = 120.0,
                 cache_size: int = 1, *, address: str | None = None, resource: str | None = None,
                 python: str | None = None, num_cpus: float = DEFAULT_NUM_CPUS,
                 placement_timeout_s: float = 60.0, call_margin_s: float = 30.0,
                 init_kwargs: dict[str, Any] | None = None, plugins: Sequence[str] = (),
                 memory_mib: int | None = DEFAULT_MEMORY_MIB, spread: bool = True):
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
        if spread:
            self.actor_options["scheduling_strategy"] = "SPREAD"
        self.nodes = ClusterNodes(resource, balance=spread)
        self.started_ray = _ensure_ray(address, init_kwargs)
        self.workers: list[RayEnvWorker] = []
        try:
            self.workers = [RayEnvWorker(self, i) for i in range(n)]
            self._wait_placed(self.workers)
        except BaseException:
            self.close()
            raise

    def _wait_placed(self, workers: list[RayEnvWorker]) -> None:
        """Block until these actors run (their constructors done), at most placement_timeout_s.
        An actor that died with a node before it ran (placed there while Ray still counted the
        node alive) is placed again elsewhere within the same wait."""
        import ray

        deadline = time.monotonic() + self.placement_timeout_s
        pending = {w.actor.ping.remote(): w for w in workers}
        facts: dict[int, dict[str, Any]] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                for w in workers:
                    w.kill()
                raise EnvSetupError(
                    f"environment actors were not placed within {self.placement_timeout_s:.0f} s: each asks for "
                    f"{_plain_options(self.actor_options)}, the cluster has {_rounded(ray.cluster_resources())}, "
                    f"free now: {_rounded(ray.available_resources())}" + self.nodes.advice()) from None
            w = pending.pop(done[0])
            try:
                facts[w.index] = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                if not _died_with_its_node(exc):  # arpo_lib missing on the node, say
                    for other in workers:
                        other.kill()
                    raise EnvSetupError(f"an environment actor could not start: {_plain(exc)}") from None
                w.actor = w._create(self.nodes.emptiest(self.workers))
                pending[w.actor.ping.remote()] = w
        errors = [f["setup_error"] for f in facts.values() if f["setup_error"]]
        if errors:
            for w in workers:
                w.kill()
            raise EnvSetupError(f"an environment actor could not start its worker: {errors[0]}")
        for w in workers:
            w.node_id = facts[w.index]["node_id"]
            self.nodes.seen.add(w.node_id)

    def placement(self) -> dict[str, int]:
        """Node id -> how many of this pool's actors run there."""
        return dict(Counter(w.node_id for w in self.workers if w.node_id is not None))

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
        use_token_when_there_is_one()
        kwargs["address"] = address
    kwargs.update(init_kwargs or {})
    ray.init(**kwargs)
    return True


def use_token_when_there_is_one() -> None:
    """Authenticate to a cluster with Ray's token whenever one is at hand (RAY_AUTH_TOKEN, or the
    file RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token names) and RAY_AUTH_MODE does not say otherwise.
    Ray 2.60 starts a head with token authentication when a token exists there (its own
    `ray.init()` makes one), but a node or driver joining at an explicit address looks for none
    unless told: it is refused. A token sent to a head without authentication does no harm."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or (os.path.isfile(path) and os.path.getsize(path) > 0):
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray._raylet" in sys.modules:  # Ray read its settings when imported: again, as Ray itself does
            from ray._raylet import Config

            Config.initialize("")


def _answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at host:port within `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _died_with_its_node(exc: BaseException) -> bool:
    """Ray's word that an actor died because its node did (or its node stopped answering)."""
    import ray

    return isinstance(exc, ray.exceptions.ActorUnavailableError) or "node has died" in str(exc)


def _plain_options(options: dict[str, Any]) -> dict[str, Any]:
    """The actor options as a reader wants them (a scheduling strategy object by its name)."""
    return {k: (v if isinstance(v, (str, int, float, dict)) else type(v).__name__) for k, v in options.items()}


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
