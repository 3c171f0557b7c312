"""Pushing a trainer's updated weights to the servers that generate its rollouts.

Three ways, chosen with `rollout.weight_sync` (`SYNC_MODES`; docs/serving.md has the measured
trade-offs): `StreamSync` broadcasts the tensors, `ReloadSync` has the running servers read a saved
model directory in place, `RestartSync` starts new servers on it. What a push asks of vLLM's
servers (pause, reset the caches, resume, an update, an RPC to every worker) is `ControlPlane`'s.

After `stream` and `reload` every server confirms what it loaded: the version (stream) and a
checksum of the tensors it received or read, compared with the trainer's own; a mismatch raises
`WeightSyncError` rather than letting rollouts come from weights nobody chose.

`ServedPolicy` is the trainer's side of it: it starts the server on the weights the trainer holds
(or connects to one), keeps track of which weight version the server generates with, and pushes
new weights before the next rollout. It is the trainer's `training.contracts.ServedWeights`; `FollowingServed`
(the other ranks of a distributed run) its `training.contracts.FollowingWeights`.

LoRA adapters loaded by name (`/v1/load_lora_adapter`) would move only the adapter, but the
trainer trains full weights; see docs/serving.md for how LoRA serving works on these servers.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from arpo_lib.agent.client import post_json
from arpo_lib.agent.model.shards import full_tensors
from arpo_lib.run.net import is_loopback
from arpo_lib.serving.gateway import Gateway, reachable_url
from arpo_lib.serving.vllm_ext.arpo_vllm_ext import (WeightsDigest, broadcast, digest_of_directory, open_group,
                                                     runtime_versions)

log = logging.getLogger(__name__)


def _root(url: str) -> str:
    """The server root from a base URL (`http://h:p/v1` -> `http://h:p`)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class WeightSyncError(RuntimeError):
    """A server did not confirm the weights the trainer pushed."""


class ControlPlane:
    """What every weight sync asks of the vLLM servers at `urls` (their development endpoints), one
    server after another in URL order. `timeout_s`: how long a call that waits on the servers' work
    (a pause, a load) may take; the quick ones get a minute and retries."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 600.0):
        self.roots, self.timeout_s = [_root(u) for u in urls], timeout_s

    def each(self) -> list[tuple[str, ControlPlane]]:
        """(root, that server's own control plane): to act on a server's answer before asking the next."""
        return [(root, ControlPlane([root], self.timeout_s)) for root in self.roots]

    def post(self, path: str, body: Any = None, *, timeout_s: float | None = None, retries: int = 0) -> list[Any]:
        return [post_json(root + path, body, timeout_s=timeout_s or self.timeout_s, retries=retries)
                for root in self.roots]

    def get(self, path: str) -> list[Any]:
        answers = []
        for root in self.roots:
            with urllib.request.urlopen(root + path, timeout=30) as resp:
                answers.append(json.loads(resp.read() or b"null"))
        return answers

    def rpc(self, method: str) -> list[list[Any]]:
        """Each server's answers to `method` of our worker extension, one per worker."""
        answers = self.post("/collective_rpc", {"method": method}, timeout_s=60, retries=1)
        return [(a or {}).get("results", []) for a in answers]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Requests in flight finish first and new ones wait; once the weights have changed no answer
        comes from a cache the old ones filled (encoder outputs, multimodal inputs, prefix KV); the
        servers resume even after a failure."""
        self.post("/pause?mode=wait")
        try:
            yield
            for cache in ("/reset_encoder_cache", "/reset_mm_cache", "/reset_prefix_cache"):
                self.post(cache, timeout_s=60, retries=1)
        finally:
            self.post("/resume", timeout_s=60, retries=2)

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """vLLM's weight-transfer update, begun and (unless it failed) finished as weight version `version`."""
        self.post("/start_weight_update")
        yield
        self.post("/finish_weight_update", {"weight_version": str(version)})

    @contextlib.contextmanager
    def posting(self, path: str, bodies: Sequence[Any]) -> Iterator[None]:
        """POST `bodies` (one per server) to every server at once: they answer once the block has
        joined them in a collective; the first failure is raised after it."""
        with ThreadPoolExecutor(max_workers=len(self.roots), thread_name_prefix="arpo-stream") as pool:
            jobs = [pool.submit(post_json, root + path, body, timeout_s=self.timeout_s, retries=0)
                    for root, body in zip(self.roots, bodies)]
            yield
            for job in jobs:
                job.result()


def reload_weights(server_url: str, model_dir: str | Path, *, timeout_s: float = 600.0,
                   expect: str | None = None) -> dict[str, Any]:
    """Make a running vLLM server (weight_sync enabled) serve the weights in `model_dir`.

    Requests in flight finish first (`ControlPlane.paused`); afterwards no answer can come from a
    cache filled by the old weights. Returns timings and what the extension reported. `expect`:
    the checksum of the directory's tensors (`digest_of_directory`); every worker must report it."""
    server = ControlPlane([server_url], timeout_s)
    t0 = time.monotonic()
    with server.paused():
        [result] = server.post("/collective_rpc", {"method": "arpo_reload_weights",
                                                   "kwargs": {"weights_path": str(Path(model_dir).resolve())}})
    if expect is not None:
        reported = [r.get("checksum") if isinstance(r, dict) else None for r in (result or {}).get("results", [None])]
        if not reported or any(c != expect for c in reported):
            raise WeightSyncError(f"the server at {server.roots[0]} read weights with checksum(s) {reported} from "
                                  f"{model_dir}, not the {expect} the trainer saved there")
    return {"seconds": time.monotonic() - t0, "result": result}


class WeightStream:
    """The trainer's end of a streamed push (`rollout.weight_sync=stream`) to vLLM servers
    started with `serve.weight_sync=true`: one process group of the trainer (rank 0) and every
    server's workers (ranks from 1, in URL order, a server's tensor-parallel workers together).

    Args:
        urls: the servers' base URLs.
        host: the address the servers reach this process at (it hosts the group's TCPStore).
        backend: `gloo` (tensors go through host memory; any server) or `nccl` (GPU to GPU; first
            checks that every server links this process's NCCL, `check_same_nccl`).
        timeout_s: how long a broadcast or the group's start may wait for a server.
    """

    def __init__(self, urls: Sequence[str], *, host: str = "127.0.0.1", backend: str = "gloo",
                 timeout_s: float = 1800.0):
        from arpo_lib.serving.launch import free_port

        self.servers = ControlPlane(urls, timeout_s)
        self.roots, self.backend = self.servers.roots, backend
        if backend == "nccl":  # before any group: NCCL aborts (not raises) on a version mismatch
            check_same_nccl(self.roots, runtime_versions())
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.served_dtype = served_dtype(self.roots)
        sizes = [int((a or {}).get("world_size", 1)) for a in self.servers.get("/get_world_size?include_dp=true")]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world, port = 1 + sum(sizes), free_port(host)
        bodies = [{"init_info": {"master_address": host, "master_port": port, "rank_offset": offset,
                                 "world_size": world, "backend": backend, "timeout_s": timeout_s}}
                  for offset in offsets]
        with self.servers.posting("/init_weight_transfer_engine", bodies):
            self.group = open_group(master_address=host, master_port=port, rank=0, world_size=world,
                                    backend=backend, timeout_s=timeout_s)

    def push(self, params: Sequence[tuple[str, torch.Tensor]], version: int,
             dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Send `params` (name, tensor: plain, or a DTensor shard whose `full_tensor()` is
        gathered here, one at a time) as weight version `version`, cast to `dtype` (None: the
        dtype the servers hold their weights in, `served_dtype`), and check that every server
        confirms the version and the checksum."""
        t0 = time.monotonic()
        wire = [dtype or self.served_dtype or p.dtype for _, p in params]
        info = {"names": [n for n, _ in params], "dtype_names": [str(d).removeprefix("torch.") for d in wire],
                "shapes": [list(p.shape) for _, p in params], "version": int(version)}
        digest = WeightsDigest()
        with (self.servers.paused(), self.servers.updating(version),
              self.servers.posting("/update_weights", [{"update_info": info}] * len(self.roots))):
            # the next tensor is gathered, cast, checksummed on its device and copied while this one is sent
            for _, full in full_tensors(params, self.device, wire, on_gathered=digest.add):
                broadcast(self.group, full)
                del full
        expected = digest.hexdigest()
        for root, server in self.servers.each():
            [states] = server.rpc("arpo_weight_state")
            served = (server.get("/weight_info")[0] or {}).get("weight_version")
            bad = [s for s in states if s.get("version") != int(version) or s.get("checksum") != expected]
            if not states or bad or served != str(version):
                raise WeightSyncError(f"the server at {root} did not confirm weight version {version}: its workers "
                                      f"report {states}, /weight_info {served!r}; expected checksum {expected}")
        return {"seconds": time.monotonic() - t0, "tensors": digest.count, "checksum": expected}

    def close(self) -> None:
        for root, server in self.servers.each():
            try:
                server.post("/shutdown_weight_transfer_engine", timeout_s=30)
            except Exception as exc:  # the server may be gone already
                log.debug("shutting down the weight stream of %s: %s", root, exc)
        self.group = None


def served_dtype(roots: Sequence[str]) -> torch.dtype | None:
    """The dtype every server's workers hold their weights in (`arpo_serving_dtype`), which a
    push sends its tensors in: fp32 master weights would otherwise travel at twice the bytes, to
    be cast on arrival. None when a server does not say (its weights then travel as they are);
    servers that disagree are refused (one broadcast carries one dtype to all)."""
    try:
        reports = ControlPlane(roots).rpc("arpo_serving_dtype")
    except Exception as exc:  # a server without the method: send as they are
        log.warning("a server did not say its weights' dtype (%s): the push sends them as they are", exc)
        return None
    found = {r for answers in reports for r in answers if isinstance(r, str)}
    if len(found) > 1:
        raise WeightSyncError(f"the servers hold their weights in different dtypes ({', '.join(sorted(found))}): "
                              "one weight stream carries one dtype; start them with the same serve.dtype")
    dtype = getattr(torch, found.pop(), None) if found else None
    return dtype if isinstance(dtype, torch.dtype) else None


def check_same_nccl(roots: Sequence[str], ours: dict[str, Any]) -> None:
    """Raise WeightSyncError unless every worker of the servers at `roots` links the NCCL that
    `ours` (this process's `runtime_versions()`) names: the trainer's torch and vLLM's torch live in
    different environments, and NCCL aborts a group whose members' versions differ."""
    for root, server in ControlPlane(roots).each():
        [reports] = server.rpc("arpo_runtime_versions")
        theirs = [r if isinstance(r, dict) else {} for r in reports] or [{}]
        if ours.get("nccl") is None or any(r.get("nccl") != ours["nccl"] for r in theirs):
            described = ", ".join(f"torch {r.get('torch', '?')} with NCCL {r.get('nccl') or 'none'}" for r in theirs)
            raise WeightSyncError(
                f"rollout.stream_backend=nccl needs the same NCCL on both ends: this trainer has torch "
                f"{ours.get('torch')} with NCCL {ours.get('nccl') or 'none'}, the server at {root} has {described}. "
                "Install the same torch build (hence the same NCCL) in the trainer's and vLLM's environments, or "
                "send the weights another way: rollout.stream_backend=gloo, or rollout.weight_sync=reload")


def save_for_server(save: Callable[[Path], Any], directory: Path) -> Path:
    """A model directory the server can load, written by `save(path)` (the policy's weights and
    processor: the training backend's `save_policy`); replaced atomically, so a server never reads
    a half-written directory."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save(tmp)
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        if old.exists():
            shutil.rmtree(old)
        directory.rename(old)
    tmp.rename(directory)
    if old.exists():
        shutil.rmtree(old)
    return directory


class VersionLock:
    """Requests (many at once) against pushes (one, alone): a push waits for the requests in
    flight and holds new ones back until it is done, so every response comes from one weight
    version, and that version is known (`ServedPolicy.versioned`). Pushes go first once waiting.
    A push inside a push on the same thread is the same push (a distributed run holds every rank's
    requests back around rank 0's push, which takes the lock again: `RolloutSource.weights_changed`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests = 0
        self._pushing = self._waiting_pushes = 0
        self._pusher: int | None = None  # the thread holding the push

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._pushing and not self._waiting_pushes)
            self._requests += 1
        try:
            yield
        finally:
            with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def push(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._pushing and self._pusher == me:  # nested: already held
                self._pushing += 1
            else:
                self._waiting_pushes += 1
                self._cond.wait_for(lambda: not self._pushing and not self._requests)
                self._waiting_pushes -= 1
                self._pushing, self._pusher = 1, me
        try:
            yield
        finally:
            with self._cond:
                self._pushing -= 1
                if not self._pushing:
                    self._pusher = None
                    self._cond.notify_all()


class VersionedPolicy:
    """A `ServedPolicy`'s client (or a `FollowingServed`'s, on the other ranks) whose every response
    says which weight version produced it (`Generation.weights_version`): each request holds the
    version lock, so no push lands while it runs. What asynchronous training's rollouts generate
    with. The client is looked up at each request: a restart's new servers are used at once."""

    def __init__(self, served: "ServedPolicy | FollowingServed"):
        self._served = served

    def __getattr__(self, name: str) -> Any:  # conversations, parsing, counters: the client's
        if name == "_served":
            raise AttributeError(name)
        return getattr(self._served.client, name)

    def generate(self, segments: Sequence[Any], **kwargs: Any) -> list[Any]:
        with self._served.version_lock.request():
            version = self._served.served_version
            out = self._served.client.generate(segments, **kwargs)
        for gen in out:
            gen.weights_version = version
        return out


class ServedPolicy:
    """Model servers generating a trainer's rollouts, kept on the trainer's current weights: one,
    or a fleet of `replicas` (each a whole copy of the model; episodes spread over them by
    `FleetPolicy`, every one brought to each new version before the next rollout).

    Versions: the trainer counts its weight changes (warm start, each optimizer step);
    `policy(version)` returns the client policy after making sure the servers hold that version
    (`sync`: `stream` the tensors, `reload` from disk in place, `restart` the servers, `none`
    never: off-policy on purpose).

    Args:
        connect: base URL -> a client policy (`ServerPolicy`).
        save_weights: writes the trainer's current weights as a model directory; returns it.
        sync: `none`, `stream`, `reload` or `restart` (rollout.weight_sync).
        weights: for `stream`: () -> the (name, tensor) pairs to send, in checkpoint naming
            (tensors are materialised one at a time while sending).
        wire_dtype: for `stream`: the dtype tensors travel in (None: their own), e.g. the server's.
        stream_host, stream_backend: for `stream`: this machine's address as the servers see it,
            and `gloo` or `nccl` (see `WeightStream`).
        url: an existing server's base URL, or several (a fleet started elsewhere: episodes spread
            over them, every one reloaded); None = start them with `start`.
        start: (model directory, replica index) -> a started, healthy server handle.
        initial_model: what servers started with `sync=none` load (the run's model path).
        replicas: how many servers to start (serve.replicas); started and synced in parallel.
        announce_host: a run over several nodes: the address the other nodes reach this one at.
            The URLs announced to them (`urls`) lead there: a loopback server through a `Gateway`
            that passes on its OpenAI API only, with `api_key` (see serving/gateway.py).
        api_key: the key the other ranks' clients send (for the gateways).
    """

    def __init__(self, *, connect: Callable[[str], Any], save_weights: Callable[[], str], sync: str,
                 url: str | Sequence[str] | None = None, start: Callable[[str, int], Any] | None = None,
                 initial_model: str = "", replicas: int = 1,
                 weights: Callable[[], Sequence[tuple[str, torch.Tensor]]] | None = None,
                 wire_dtype: torch.dtype | None = None, stream_host: str = "127.0.0.1", stream_backend: str = "gloo",
                 announce_host: str | None = None, api_key: str | None = None):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {tuple(SYNC_MODES)}, not {sync!r}")
        if url is None and start is None:
            raise ValueError("ServedPolicy needs a server url or a way to start one")
        if sync == "restart" and start is None:
            raise ValueError("weight sync 'restart' needs the server this run starts (no url)")
        urls = None if url is None else [url] if isinstance(url, str) else list(url)
        if urls is not None and not urls:
            raise ValueError("ServedPolicy got an empty list of server urls")
        if sync == "stream" and weights is None:
            raise ValueError("weight sync 'stream' needs the trainer's weights (weights=)")
        if announce_host is not None and not api_key:
            raise ValueError("a run over several nodes reaches the servers through a gateway that only passes on "
                             "requests with the run's API key: set serve.api_key_env (or rollout.api_key_env)")
        if replicas < 1 or (urls is not None and replicas != 1):
            raise ValueError(f"replicas must be >= 1 (and 1 for servers given by url: their number is the "
                             f"urls'), not {replicas}")
        self._connect, self.save_weights, self.sync = connect, save_weights, sync
        self._urls, self._start, self._initial_model = urls, start, initial_model
        self.replicas = len(urls) if urls is not None else replicas
        self.servers: list[Any] = []
        """The server handles, when this object started the servers."""
        self.client: Any = None
        """`ServerPolicy` (one server) or `FleetPolicy` (several)."""
        self.served_version: int | None = None
        """The trainer's weight version the servers generate with; None = unknown (someone else's server)."""
        self.seconds_sync = 0.0
        self.weights, self.wire_dtype = weights, wire_dtype
        self.stream_host, self.stream_backend = stream_host, stream_backend
        self._sync_mode = SYNC_MODES[sync](self) if SYNC_MODES[sync] else None
        self.last_push: dict[str, Any] = {}
        """What the last push reported (seconds, and the checksum the servers confirmed)."""
        self._announce_host, self._api_key = announce_host, api_key
        self._gateways: dict[str, Gateway] = {}  # by the base URL of the server behind it
        self._carried = dict.fromkeys(_COUNTERS, 0)  # counts of clients replaced by restarts
        self._carried_by_replica = [0] * self.replicas
        self.version_lock = VersionLock()
        """Held by every request of `versioned()` and by every push: no response mixes versions."""

    def versioned(self) -> VersionedPolicy:
        """The client, each response marked with the version that produced it (rollouts running
        while the trainer updates and pushes: `rollout.max_staleness`)."""
        return VersionedPolicy(self)

    @property
    def server(self) -> Any:
        """The first server's handle (None: not started here)."""
        return self.servers[0] if self.servers else None

    @property
    def urls(self) -> list[str] | None:
        """The base URLs of the servers generating now (None before the first `policy`); rank 0
        of a distributed run announces them to the other ranks. Over several nodes
        (`announce_host`), URLs the other nodes reach: a loopback server's gateway."""
        if self.client is None:
            return None
        if self._announce_host is None:
            return list(self.client.base_urls)
        for url in set(self._gateways) - set(self.client.base_urls):  # servers gone (restarted)
            self._gateways.pop(url).close()
        return [self._reachable(url) for url in self.client.base_urls]

    def _reachable(self, url: str) -> str:
        if not is_loopback(urllib.parse.urlsplit(url).hostname or ""):
            return reachable_url(url, self._announce_host)
        if url not in self._gateways:
            self._gateways[url] = Gateway(_root(url), self._announce_host, self._api_key)
        return self._gateways[url].base_url

    def policy(self, version: int) -> Any:
        """The client policy, its servers holding weight version `version` (unless sync is none)."""
        if self.client is None:
            if self._urls is None:  # our own servers, started on the weights we hold now
                self._start_all(self.save_weights() if self.sync != "none" else self._initial_model)
                self.served_version = version
            else:  # someone else's servers: what they hold is unknown, so they get our weights first
                self.client = connect_all(self._connect, self._urls)
            if self.sync == "none" and version > 0:
                log.warning("rollout.weight_sync=none, so the server does not have the weights of the warm "
                            "start or of the updates: rollouts are off-policy")
        if self.served_version != version and self._sync_mode is not None:
            with self.version_lock.push():  # after the requests in flight; new ones wait for it
                t0 = time.monotonic()
                self.last_push, self.served_version = self._sync_mode.push(version), version
                self.seconds_sync += time.monotonic() - t0
        return self.client

    def passes_over_weights(self, version: int) -> bool:
        """Whether `policy(version)` reads the trainer's weights (saves or sends them, once): the
        ranks of a distributed run whose weights exist only as shards take part in that pass."""
        return self.sync != "none" and (self.client is None or self.served_version != version)

    def _start_all(self, model_dir: str) -> None:
        """Start every replica at once; if one fails, stop the others and raise its error."""
        with ThreadPoolExecutor(max_workers=self.replicas, thread_name_prefix="arpo-serve") as pool:
            jobs = [pool.submit(self._start, model_dir, i) for i in range(self.replicas)]
            wait(jobs)
        failed = [j.exception() for j in jobs if j.exception() is not None]
        self.servers = [j.result() for j in jobs if j.exception() is None]
        if failed:
            self._stop_all()
            raise failed[0]
        self.client = connect_all(self._connect, [s.base_url for s in self.servers])

    def _stop_all(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []

    def restart(self, model_dir: str) -> None:
        """Replace the servers by new ones on `model_dir`; what the old clients counted stays in the run's totals."""
        for counter in _COUNTERS:
            self._carried[counter] += getattr(self.client, counter)
        for i, requests in enumerate(_requests_by_replica(self.client)):
            self._carried_by_replica[i] += requests
        self.client.close()
        self._stop_all()
        self._start_all(model_dir)

    def metrics(self) -> dict[str, Any]:
        if self.client is None:
            return {}
        c = self.client
        out = {f"server_{name}": self._carried[name] + getattr(c, name) for name in _COUNTERS}
        if len(c.base_urls) > 1:
            out["server_requests_by_replica"] = [carried + now for carried, now in
                                                 zip(self._carried_by_replica, _requests_by_replica(c))]
        return {**out, "seconds_sync_total": round(self.seconds_sync, 3)}

    def close(self) -> None:
        if self._sync_mode is not None:
            self._sync_mode.close()
        for gateway in self._gateways.values():
            gateway.close()
        self._gateways = {}
        if self.client is not None:
            self.client.close()
            self.client = None
        self._stop_all()


class SyncMode:
    """How `ServedPolicy` brings its servers to a new weight version (`SYNC_MODES`): `push(version)`
    returns what they confirmed (`last_push`); `close()` lets go of what the pushes hold open."""

    def __init__(self, served: ServedPolicy):
        self.served = served

    def push(self, version: int) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class StreamSync(SyncMode):
    """`stream`: vLLM's weight-transfer lifecycle with our engine `arpo_stream` (see
    `vllm_ext/arpo_vllm_ext.py`): the trainer broadcasts one tensor at a time, in the server's
    dtype, to every replica at once over a process group of its own (`WeightStream`: gloo on the
    CPU, NCCL on GPUs); nothing touches the disk and no full state dict is built. Needs
    `serve.weight_sync=true` and servers that can reach this machine's `rollout.stream_host`."""

    stream: WeightStream | None = None

    def push(self, version: int) -> dict[str, Any]:
        served = self.served
        if self.stream is None:  # its servers stay the same: only a restart replaces them
            self.stream = WeightStream(served.client.base_urls, host=served.stream_host, backend=served.stream_backend)
        return self.stream.push(list(served.weights()), version, served.wire_dtype)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


class ReloadSync(SyncMode):
    """`reload`: the weights are saved as a model directory, which every running vLLM server
    (started with `serve.weight_sync=true`: dev endpoints and our worker extension) reloads in
    place, all at once (`reload_weights`). No restart, no re-compilation; the server keeps its KV
    memory. The server must be able to read the directory (same machine or shared storage)."""

    def push(self, version: int) -> dict[str, Any]:
        model_dir, urls = self.served.save_weights(), self.served.client.base_urls
        expect = digest_of_directory(model_dir)["checksum"]
        with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="arpo-sync") as pool:
            list(pool.map(lambda url: reload_weights(url, model_dir, expect=expect), urls))
        return {"checksum": expect}


class RestartSync(SyncMode):
    """`restart`: stop the servers and start new ones on the saved directory. Works with any backend
    (our `hf` server, a vLLM without dev mode), costs a full start-up per update (vLLM: ~30-60 s on
    CPU, minutes for a 7B model on GPU with compilation)."""

    def push(self, version: int) -> dict[str, Any]:
        self.served.restart(self.served.save_weights())
        return {}


SYNC_MODES = {"none": None, "stream": StreamSync, "reload": ReloadSync, "restart": RestartSync}
"""`rollout.weight_sync` -> how each new version reaches the servers (`none`: it never does)."""

_COUNTERS = ("requests", "prompt_mismatches", "inexact")


def _requests_by_replica(client: Any) -> list[int]:
    return [c.requests for c in getattr(client, "clients", [client])]


def connect_all(connect: Callable[[str], Any], urls: Sequence[str], rank: int = 0) -> Any:
    """One client for the servers at `urls`: a `ServerPolicy`, or a `FleetPolicy` over several
    whose first choice is server `rank % len(urls)` (training process `rank`'s)."""
    from arpo_lib.agent.server_policy import FleetPolicy

    clients = [connect(url) for url in urls]
    return clients[0] if len(clients) == 1 else FleetPolicy(clients, first=rank)


class FollowingServed:
    """The servers of a distributed run, seen from a training process other than rank 0: it
    connects to the URLs rank 0 announces before each rollout batch (`RolloutSource.acting`) and
    never pushes weights (rank 0 has, before announcing). Rank 0 records the servers' metrics."""

    def __init__(self, connect: Callable[[str], Any], rank: int = 0):
        self._connect, self.rank = connect, rank
        self.client: Any = None
        self.urls: list[str] | None = None
        self.served_version: int | None = None
        """The weight version rank 0 last said its servers hold (`learned`)."""
        self.version_lock = VersionLock()
        """Held by this rank's requests of `versioned()` and, around rank 0's push, by the trainer."""

    def versioned(self) -> VersionedPolicy:
        """This rank's client, each response marked with the version that produced it: rank 0's
        pushes land while every rank holds its requests back (`RolloutSource.weights_changed`)."""
        return VersionedPolicy(self)

    def learned(self, version: int, urls: Sequence[str] | None) -> None:
        """Rank 0 has brought its servers (now at `urls`) to weight version `version`. Called with
        the version lock held, so no request of this rank straddles the change."""
        if urls:
            self.follow(urls)
        self.served_version = version

    def follow(self, urls: Sequence[str]) -> Any:
        """The client of the servers at `urls` (a new one when rank 0's servers moved, e.g. restarted)."""
        if list(urls) != self.urls:
            if self.client is not None:
                self.client.close()
            self.client, self.urls = connect_all(self._connect, urls, self.rank), list(urls)
        return self.client

    def passes_over_weights(self, version: int) -> bool:
        return False  # rank 0 pushes; it tells this rank when to join the gathers (RolloutSource)

    def policy(self, version: int) -> Any:
        if self.client is None:
            raise RuntimeError("no server announced yet: rank 0 announces its servers in RolloutSource.acting")
        return self.client

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
