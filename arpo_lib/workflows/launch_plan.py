"""A launch checked whole before anything starts (`./workbench train --dry-run`).

A run over several GPUs and nodes can be refused late: the trainer compares serve.cuda_devices with
its node's processes only once torchrun has started them on their allocation
(`build.check_server_gpus_are_free`), and a missing API key or an unreachable Ray head shows only
when rank 0 starts its servers or its environments. Here the same rules are applied to the launch
the command line describes, on any machine (a login node without GPUs too): processes per node
against the GPUs of a node and the GPUs the run's own servers take, what a run over several nodes
needs (a rendezvous address that resolves, a key for the servers' gateway, a run directory every
node reads), and whether the Ray head answers. Nothing is started and no model is loaded.

    facts = gather_facts(cfg, launch)                # the probes: GPU count, the master's address, the Ray head
    plan = plan_launch(cfg, launch, facts)           # pure: the plan and every problem with its fix
    print(plan.report())
"""
from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Mapping

from arpo_lib import build
from arpo_lib.run.config import ConfigError, RunConfig, server_urls
from arpo_lib.run.net import is_loopback

RAY_GCS_PORT = 6379
"""The port `ray start --head` serves its cluster's control store on unless told otherwise."""

PROBE_TIMEOUT_S = 3.0
"""How long the dry run waits for the Ray head to accept a connection."""


@dataclass(frozen=True)
class Launch:
    """What the command line asks for (`train`'s launch options)."""

    nproc_per_node: int | None = None
    """Training processes per node; None: train.nproc_per_node."""
    nnodes: int = 1
    """Nodes, each running the same command."""
    master_addr: str = "127.0.0.1"
    """The rendezvous node's address."""
    master_port: int = 29500
    """The rendezvous port on that node."""
    rdzv_id: str = "arpo"
    """The run's rendezvous id."""
    gpus_per_node: int | None = None
    """GPUs of each node (`--gpus-per-node`); None: found on this machine (`count_gpus`)."""


@dataclass(frozen=True)
class GpuCount:
    """GPUs per node and where that number comes from."""

    count: int | None
    """None: unknown (no flag, no SLURM or CUDA variable, no nvidia-smi here)."""
    source: str
    """`--gpus-per-node`, `SLURM_GPUS_PER_NODE`, `CUDA_VISIBLE_DEVICES`, `nvidia-smi -L` or `unknown`."""
    visible: list[str] | None = None
    """The GPU ids CUDA_VISIBLE_DEVICES lists, when the count comes from it (process k takes the k-th)."""


@dataclass(frozen=True)
class Facts:
    """What the dry run found out beyond the config (`gather_facts`): the only I/O of a plan."""

    gpus: GpuCount
    master_resolves: str | None = None
    """Why the rendezvous address does not resolve here (None: it does, or one node)."""
    ray_head: str | None = None
    """Why env.ray_address does not accept a connection (None: it does, or nothing to try)."""
    key_is_set: bool = True
    """Whether the servers' API key variable is set in this environment."""


@dataclass(frozen=True)
class Problem:
    """Something that would stop the launch, and what to do instead."""

    what: str
    fix: str


@dataclass(frozen=True)
class NodePlan:
    """What runs on one node (or on each of several alike)."""

    name: str
    """`rank 0's node`, `each other node (N)` or `this machine`."""
    ranks: str
    """The ranks it holds, e.g. `0-5`."""
    training_gpus: list[str]
    """The GPUs its training processes take (empty: they train on the CPU)."""
    serving_gpus: list[str]
    """The GPUs the run's own servers take there."""
    idle_gpus: list[str]
    """GPUs of the node nothing takes (only when the count is known)."""
    environments: str
    """The environment workers it hosts."""


@dataclass
class LaunchPlan:
    """The launch as it would run: processes, GPUs per node, servers, environments; problems with
    their fixes (none: `ok`) and notes that need no change."""

    config: str
    processes: str
    gpus: GpuCount
    nodes: list[NodePlan]
    servers: str
    environments: str
    notes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        count, source = self.gpus.count, self.gpus.source
        gpus = "unknown (give --gpus-per-node N)" if count is None else f"{count} ({source})"
        lines = [f"launch plan for {self.config}", f"  processes:     {self.processes}", f"  GPUs per node: {gpus}"]
        for node in self.nodes:
            train = f"GPU{'s' * (len(node.training_gpus) > 1)} {_ids(node.training_gpus)}" if node.training_gpus \
                else "the CPU"
            several = "-" in node.ranks
            text = f"ranks {node.ranks} train on {train}" if several else f"rank {node.ranks} trains on {train}"
            if node.serving_gpus:
                text += f"; the servers on GPUs {_ids(node.serving_gpus)}"
            if node.idle_gpus:
                text += f"; idle: GPUs {_ids(node.idle_gpus)}"
            lines += [f"  {node.name}: {text}", f"      environments: {node.environments}"]
        lines += [f"  servers:       {self.servers}", f"  environments:  {self.environments}"]
        if self.notes:
            lines += ["notes:"] + [f"  - {note}" for note in self.notes]
        if self.problems:
            lines.append(f"problems ({len(self.problems)}):")
            for i, p in enumerate(self.problems, 1):
                lines += [f"  {i}. {p.what}", f"     fix: {p.fix}"]
        else:
            lines.append("launch OK")
        return "\n".join(lines)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "es" if thing.endswith("s") else "s")


def _ids(gpus: list[str]) -> str:
    """`0-5` for a run of three or more consecutive GPU numbers, else `6, 7`."""
    numbers = [int(g) for g in gpus if g.isdigit()]
    if len(numbers) == len(gpus) > 2 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(gpus)


# -- the probes --------------------------------------------------------------------------------------

def count_gpus(given: int | None, environ: Mapping[str, str], nvidia_smi: str | None = None) -> GpuCount:
    """GPUs per node: `given` (the flag), else SLURM_GPUS_PER_NODE (`8`, `h100:8`), else the
    CUDA_VISIBLE_DEVICES list, else the lines of `nvidia-smi -L` (`nvidia_smi`: its path; None:
    looked up on PATH), else unknown."""
    if given is not None:
        return GpuCount(given, "--gpus-per-node")
    slurm = environ.get("SLURM_GPUS_PER_NODE", "")
    counts = [int(m) for part in slurm.split(",") if (m := part.rsplit(":", 1)[-1].strip()).isdigit()]
    if counts:
        return GpuCount(sum(counts), "SLURM_GPUS_PER_NODE")
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible:
        return GpuCount(len(visible), "CUDA_VISIBLE_DEVICES", visible)
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None and listed.returncode == 0:
            return GpuCount(sum(line.startswith("GPU ") for line in listed.stdout.splitlines()), "nvidia-smi -L")
    return GpuCount(None, "unknown")


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) a Ray address is served at: `ray://h:p` (Ray Client), `h:p` or `h` (the control
    store's default port); None for `auto` (the cluster this node joined: nothing to dial)."""
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        host, port = rest, str(RAY_GCS_PORT)
    return host.strip("[]"), int(port)


def tcp_problem(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing accepts a TCP connection at host:port within `timeout_s` (None: something does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return str(exc) or type(exc).__name__


def resolve_problem(host: str) -> str | None:
    """Why `host` does not resolve here (None: it does)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return None
    except OSError as exc:
        return str(exc)


def gather_facts(cfg: RunConfig, launch: Launch, environ: Mapping[str, str] | None = None) -> Facts:
    """The probes a plan needs: GPUs per node, whether the rendezvous address resolves (several
    nodes), whether the Ray head at env.ray_address accepts a connection, whether the servers'
    API key variable is set here."""
    environ = os.environ if environ is None else environ
    endpoint = ray_endpoint(cfg.env.ray_address) if cfg.env.backend == "ray" and cfg.env.ray_address else None
    ray_head = None
    if endpoint is not None:
        ray_head = tcp_problem(*endpoint)
    key_env = cfg.rollout.api_key_env or cfg.serve.api_key_env
    return Facts(gpus=count_gpus(launch.gpus_per_node, environ),
                 master_resolves=resolve_problem(launch.master_addr) if launch.nnodes > 1 else None,
                 ray_head=ray_head, key_is_set=bool(key_env and environ.get(key_env)))


# -- the plan ----------------------------------------------------------------------------------------

def processes_per_node(cfg: RunConfig, launch: Launch) -> int:
    """The flag, else train.nproc_per_node (as `train` reads them)."""
    return launch.nproc_per_node or cfg.train.nproc_per_node


def starts_own_servers(cfg: RunConfig) -> bool:
    """Whether the run's rank 0 starts model servers (rollout.backend=server without server_url)."""
    return cfg.rollout.backend == "server" and not server_urls(cfg)


def plan_launch(cfg: RunConfig, launch: Launch, facts: Facts, config: str = "the config") -> LaunchPlan:
    """The launch `launch` of `cfg` as it would run, with every problem the trainer would meet
    (each with its fix) and notes. Pure: the machine's answers come in `facts`."""
    problems: list[Problem] = []
    notes: list[str] = []
    nproc, nnodes = processes_per_node(cfg, launch), launch.nnodes
    world = nproc * nnodes
    torchrun = nproc > 1 or nnodes > 1
    gpus = facts.gpus
    on_gpus = cfg.model.device != "cpu" and (gpus.count > 0 if gpus.count is not None
                                             else cfg.model.device.startswith("cuda") or bool(cfg.serve.cuda_devices))
    if gpus.count is None and cfg.model.device == "auto" and not on_gpus:
        notes.append("GPUs per node unknown: checked as a run on the CPU; give --gpus-per-node N for the nodes it "
                     "will run on")

    # -- GPUs: the training processes, the servers' GPUs, and the two apart
    if on_gpus:
        single = re.fullmatch(r"cuda:(\d+)", cfg.model.device)
        training = [single.group(1)] if single and not torchrun else build.training_gpus(nproc, gpus.visible)
    else:
        training = []
    own_servers = starts_own_servers(cfg)
    serving = build.serving_gpus(cfg) if own_servers and cfg.serve.device != "cpu" and on_gpus else []
    if gpus.count is not None and on_gpus and nproc > gpus.count:
        problems.append(Problem(f"{nproc} training processes per node, but a node has {gpus.count} GPUs",
                                f"use --nproc-per-node {max(gpus.count - len(serving), 1)}"
                                + (f" (GPUs {_ids(serving)} serve)" if serving else "")))
    if own_servers and on_gpus:
        if cfg.serve.cuda_devices is None:
            try:
                build.check_gpus(cfg, on_gpus=True)
            except ConfigError as exc:
                problems.append(Problem(str(exc), "set serve.cuda_devices to GPUs the training processes do not "
                                                  f"take (they take GPUs {_ids(training)})"))
        elif clash := build.server_gpu_clash(cfg, training):
            fit = clash.processes_that_fit
            fix = (f"use --nproc-per-node {fit} (GPUs {_ids(serving)} serve)" if fit else clash.fix())
            problems.append(Problem(f"the servers' GPUs {_ids(clash.shared)} (serve.cuda_devices) are ones the "
                                    f"{len(training)} training processes of rank 0's node take (GPUs "
                                    f"{_ids(training)})", fix))
        for i, entry in enumerate(cfg.serve.cuda_devices or []):
            given = [d for d in str(entry).split(",") if d.strip()]
            if len(given) < cfg.serve.tensor_parallel_size:
                problems.append(Problem(f"serve.cuda_devices[{i}] gives replica {i} {len(given)} GPU(s) ({entry}), "
                                        f"serve.tensor_parallel_size is {cfg.serve.tensor_parallel_size}",
                                        f"give each replica {cfg.serve.tensor_parallel_size} GPUs, or lower "
                                        "serve.tensor_parallel_size"))
        if gpus.count is not None and gpus.visible is None:
            missing = [g for g in serving if not (g.isdigit() and int(g) < gpus.count)]
            if missing:
                problems.append(Problem(f"serve.cuda_devices names GPU(s) {_ids(missing)}, but a node has "
                                        f"{gpus.count} GPUs (0-{gpus.count - 1})",
                                        "give the servers GPUs the node has, past the training processes'"))

    # -- several nodes
    key_env = cfg.rollout.api_key_env or cfg.serve.api_key_env
    if nnodes > 1:
        if is_loopback(launch.master_addr):
            notes.append(f"--master-addr {launch.master_addr}: only nodes on this machine reach it (a test on one "
                         "machine); on a cluster give the address of the node that hosts the rendezvous")
        elif facts.master_resolves:
            problems.append(Problem(f"--master-addr {launch.master_addr} does not resolve here "
                                    f"({facts.master_resolves})",
                                    "give the address or host name of the node that hosts the rendezvous (under "
                                    "SLURM the job's first node)"))
        if not 0 < launch.master_port < 65536:
            problems.append(Problem(f"--master-port {launch.master_port} is not a port",
                                    "give a free port, e.g. 29500"))
        notes.append(f"{cfg.run_dir} must be on a file system every node shares (checkpoints, trajectories, the "
                     "servers' weights, the task data)")
        if own_servers:
            if key_env is None:
                problems.append(Problem("the other nodes reach rank 0's servers through a gateway that passes on only "
                                        "key-protected /v1 requests, and no key is named (serve.api_key_env)",
                                        "set serve.api_key_env=ARPO_SERVE_API_KEY and export ARPO_SERVE_API_KEY, the "
                                        "same long random value, on every node (scripts/slurm_train.sh makes one)"))
            elif not facts.key_is_set:
                notes.append(f"{key_env} (the servers' API key) is not set here: export the same value on every "
                             "node before the launch (scripts/slurm_train.sh makes one)")
            host = cfg.serve.announce_host
            if host and (is_loopback(host) or host.strip("[]") in ("0.0.0.0", "::")):
                problems.append(Problem(f"serve.announce_host {host!r} cannot be reached from other nodes",
                                        "give rank 0's node's address on the network the nodes share, or leave it "
                                        "unset (MASTER_ADDR: rank 0's host name)"))
            elif not host:
                notes.append("rank 0 announces its servers' gateway at MASTER_ADDR (rank 0's host name, as the "
                             "rendezvous hands it out) unless serve.announce_host names another address")

    # -- environments
    per_rank = math.ceil(cfg.env.workers / world)
    if cfg.env.backend == "local":
        environments = f"{cfg.env.workers} (env.workers): {_count(per_rank, 'local worker process')} per rank"
        on_node = f"{_count(per_rank * nproc, 'local worker process')} ({per_rank} per rank)"
    elif cfg.env.ray_address is None:
        environments = (f"{cfg.env.workers} (env.workers): {_count(per_rank, 'Ray actor')} per rank, on a private Ray "
                        "each rank starts")
        on_node = f"{_count(per_rank * nproc, 'Ray actor')} on private Rays of its ranks"
        if torchrun:
            notes.append("env.ray_address is unset: every rank starts a private Ray on its own node, so the "
                         "environments run on the training nodes")
    else:
        slot = f", one {cfg.env.ray_resource} each" if cfg.env.ray_resource else ""
        environments = (f"{cfg.env.workers} (env.workers): {_count(per_rank, 'Ray actor')} per rank on the cluster at "
                        f"{cfg.env.ray_address}{slot}")
        on_node = (f"none (on the nodes offering {cfg.env.ray_resource})" if cfg.env.ray_resource
                   else "any of the cluster's Ray actors (no env.ray_resource: any node with CPUs)")
        notes.append("every training node must be a node of the Ray cluster (a driver attaches to a raylet on its "
                     "own host): join it with scripts/ray_env_node.sh HEAD:PORT --slots 0")
        if cfg.env.ray_address == "auto":
            notes.append("env.ray_address=auto: each rank attaches to the cluster its node has joined")
        elif facts.ray_head:
            problems.append(Problem(f"env.ray_address {cfg.env.ray_address}: the Ray head does not answer "
                                    f"({facts.ray_head})",
                                    "start the head there (scripts/ray_head.sh prints its address) or correct "
                                    "env.ray_address"))

    # -- servers
    if cfg.rollout.backend != "server":
        servers = "none: every rank generates with its own copy of the model (rollout.backend=hf)"
    elif not own_servers:
        servers = f"started elsewhere: {', '.join(server_urls(cfg))} (rollout.server_url)"
    else:
        where = f"on GPUs {' | '.join(str(e) for e in cfg.serve.cuda_devices)}" if serving else f"on {cfg.serve.device}"
        servers = (f"{cfg.serve.replicas} {cfg.serve.backend} server(s) on rank 0's node {where}, tensor parallel "
                   f"{cfg.serve.tensor_parallel_size}, weights kept current by rollout.weight_sync="
                   f"{cfg.rollout.weight_sync}")
        if nnodes > 1:
            servers += f"; the other nodes reach them through a gateway that wants {key_env or 'a key'}"

    # -- per node
    def idle(taken: list[str]) -> list[str]:
        if gpus.count is None or not on_gpus:
            return []
        every = gpus.visible or [str(i) for i in range(gpus.count)]
        return [g for g in every if g not in taken]

    first = NodePlan("this machine" if nnodes == 1 else "rank 0's node", f"0-{nproc - 1}" if nproc > 1 else "0",
                     training, serving, idle(training + serving), on_node)
    nodes = [first]
    if nnodes > 1:
        others = f"{nproc}-{world - 1}" if nnodes == 2 else f"{nproc} each of {nproc}-{world - 1}"
        nodes.append(NodePlan(f"each other node ({nnodes - 1})", others, training, [], idle(training), on_node))
    if torchrun:
        processes = (f"{nproc} per node x {nnodes} node(s) = {world} ranks (torchrun"
                     + (f", c10d rendezvous at {launch.master_addr}:{launch.master_port}, id {launch.rdzv_id})"
                        if nnodes > 1 else ", standalone)"))
    else:
        processes = f"1 (no torchrun), on model.device={cfg.model.device}"
    return LaunchPlan(config, processes, gpus, nodes, servers, environments, notes, problems)


def check_launch(cfg: RunConfig, launch: Launch, config: str = "the config",
                 environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """`train --dry-run`: the plan of the launch (`plan_launch` on what `gather_facts` finds) and
    the memory planner's verdict (`workflows.train.check_fit`, as `train` asks it before starting:
    on a machine with a GPU), a run that would not fit being one more problem."""
    from arpo_lib.training.plan import DoesNotFit
    from arpo_lib.workflows.train import check_fit

    plan = plan_launch(cfg, launch, gather_facts(cfg, launch, environ), config)
    try:
        check_fit(cfg)
    except DoesNotFit as exc:
        plan.problems.append(Problem(f"the memory planner: the run does not fit this GPU\n{exc}",
                                     f"apply the levers above (`./workbench plan --config {config} --write FILE` "
                                     "writes them), or train.plan_check=false to skip the check"))
    return plan
