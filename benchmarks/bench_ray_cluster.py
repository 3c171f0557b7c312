"""Environments on other nodes of a Ray cluster against local worker processes, in one run.

Each arm trains the same ARPO steps from the same weights on the same MiniWoB++ tasks, one arm after
the other, with its policy behind our `hf` server (rollout.backend=server, so that batches can play
ahead of the update):

    local_lockstep    env.backend=local: a worker process per environment, on pipes; ARPO's loop
    cluster_lockstep  env.backend=ray on a `ray.cluster_utils.Cluster`: a head without env_slot and
                      two worker nodes offering them, the actors spread over the two
    local_async       rollout.mode=async, rollout.max_staleness=1 (the next batch plays during the update)
    cluster_async     the same on the cluster

Per arm: training steps per hour (the wall time of `trainer.train()` after one untimed step that
starts the server, the pool and the caches), the share of that time the environments were busy
(busy seconds summed over the workers / (workers x wall)), those busy seconds per environment step,
and where the actors ran. Other work on the machine slows whichever arm it overlaps: each arm
records the share of the CPU left idle meanwhile and the load average at its end. Beside the
arms, the round trip of one environment call that does nothing (`ping`): a local worker's pipe
against an actor on a worker node. Last, a node lost: one of the two worker nodes removed while its
actor resets a browser, timed until the episode's error (and the actor's replacement), until none
of the lost actor's processes runs, and until Ray counts the node dead.

What it can show on one machine: the cost of reaching environments through Ray's actors and other
raylets (serialisation, the object store, the scheduler), and that the schedules work unchanged
across nodes. What it cannot: the nodes share this machine's cores and loopback, so the gain of
moving environments off the trainer's cores (the point of environment nodes) and a real network's
latency are not in these figures.

    python benchmarks/bench_ray_cluster.py --steps 3          # benchmarks/results/ray_cluster.json
    python benchmarks/bench_ray_cluster.py --small --out DIR  # one timed step of the tiny model (the test)
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_async import command_args, cpu_times, idle_fraction  # noqa: E402
from benchmarks.common import table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "local_lockstep": ("local", ["rollout.mode=lockstep", "rollout.max_staleness=0"]),
    "cluster_lockstep": ("cluster", ["rollout.mode=lockstep", "rollout.max_staleness=0"]),
    "local_async": ("local", ["rollout.mode=async", "rollout.max_staleness=1"]),
    "cluster_async": ("cluster", ["rollout.mode=async", "rollout.max_staleness=1"]),
}
"""In the order they run (each local arm right before its cluster twin)."""
WHERE = {"local": ["env.backend=local"],
         "cluster": ["env.backend=ray", "env.ray_resource=env_slot", "env.ray_num_cpus=0"]}
CONFIG = "configs/smoke.yaml"
COMMON = ["env.workers=4", "rollout.group_size=4", "train.tasks_per_batch=2", "train.updates_per_batch=2",
          "warm_start.steps=0", "warm_start.demos_per_task=0", "train.eval_every=0", "rollout.backend=server",
          "serve.backend=hf", "rollout.weight_sync=restart", "logging.progress=false"]
SIZES = {"full": ("models/small-uitars-qwen2vl-smoke", ["env.max_steps=4"]),
         "small": ("models/tiny-uitars-qwen2vl", ["env.max_steps=2", "model.max_new_tokens=16",
                                                  "rollout.group_size=2", "train.updates_per_batch=1"])}
SLOTS = 4
"""env_slots per worker node: the 4 environments spread 2 + 2."""


class EnvCluster:
    """A head without env_slot and two worker nodes with `SLOTS` each, this process its driver."""

    def __enter__(self) -> "EnvCluster":
        import ray
        from ray.cluster_utils import Cluster

        memory = {"object_store_memory": 100 * 2**20}
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"env_slot": 0},
                                                                     "include_dashboard": False, **memory})
        self.nodes = [self.cluster.add_node(num_cpus=2, resources={"env_slot": SLOTS}, **memory) for _ in range(2)]
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def run_arm(name: str, model: str, overrides: list[str], steps: int, out: Path) -> dict[str, Any]:
    from arpo_lib import build
    from arpo_lib.run.config import load_config

    where, schedule = ARMS[name]
    cfg = load_config(CONFIG, [*COMMON, *overrides, *WHERE[where], *schedule, f"model.path={model}",
                               f"out_dir={out}", f"name={name}", f"train.steps={steps + 1}"])
    with build.trainer(cfg) as trainer:
        trainer.train(steps=1)  # untimed: the server, the environments and the caches start
        source = trainer.rollouts
        env_before = source.env_seconds
        t0, cpu0 = time.monotonic(), cpu_times()
        history = trainer.train()
        wall, cpu1 = time.monotonic() - t0, cpu_times()
        placement = sorted(source.pool.placement().values()) if where == "cluster" else None
    return {
        "arm": name, "steps": len(history), "wall_s": round(wall, 1),
        "steps_per_hour": 3600 * len(history) / wall,
        "env_busy_fraction": (source.env_seconds - env_before) / (cfg.env.workers * wall),
        # seconds a command was in flight per environment step taken (resets included): the cost of
        # one step of an environment as the engine sees it, through a pipe or an actor
        "env_seconds_per_step": (source.env_seconds - env_before) / max(1, sum(m["env_steps"] for m in history)),
        "seconds_rollout": sum(m["seconds_rollout"] for m in history),
        "seconds_update": sum(m["seconds_update"] for m in history),
        "env_errors": sum(m["env_errors"] for m in history),
        "success_rate": statistics.mean(m["success_rate"] for m in history) if history else 0.0,
        "actors_per_node": placement,
        # the machine's CPU left idle meanwhile, and its load at the end: other work on the
        # machine slows every arm it overlaps
        "cpu_idle_fraction": idle_fraction(cpu0, cpu1),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def call_round_trips(calls: int) -> dict[str, float]:
    """Median milliseconds of one `ping` to a local worker and to an actor on a worker node (the
    cluster must be up)."""
    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    def median_ms(worker: Any) -> float:
        worker.call("ping")
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            worker.call("ping")
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    with EnvPool(1, {}) as local:
        local_ms = median_ms(local.workers[0])
    with RayEnvPool(1, {}, resource="env_slot", num_cpus=0) as remote:
        remote_ms = median_ms(remote.workers[0])
    return {"local_worker_ms": local_ms, "actor_on_a_worker_node_ms": remote_ms}


def node_loss(env_cluster: EnvCluster) -> dict[str, Any]:
    """One of two worker nodes removed (its raylet killed) while its actor resets a MiniWoB++
    browser: seconds from the removal until the episode's EnvError (the actor replaced on the
    other node by then), until nothing the lost actor started runs (worker, browser, driver), and
    until Ray's control store counts the node dead. The cluster is left with one worker node."""
    import psutil
    import ray

    from arpo_lib.envs.base import EnvError
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    with RayEnvPool(2, {"scale": 2}, resource="env_slot", num_cpus=0) as pool:
        for w in pool.workers:
            w.call("reset", ("miniwob/click-test", 0))
        doomed = pool.workers[0]
        root = psutil.Process(doomed.ping()["pid"])
        started = {p.pid: p.create_time() for p in [root, *root.children(recursive=True)]}
        node = next(n for n in env_cluster.nodes if n.node_id == doomed.node_id)
        doomed.send("reset", ("miniwob/click-button", 1))
        t0 = time.monotonic()
        env_cluster.cluster.remove_node(node, allow_graceful=False)
        env_cluster.nodes.remove(node)
        error = ""
        try:
            doomed.recv()
        except EnvError as exc:
            error = str(exc)
        replaced = time.monotonic() - t0

        def running() -> int:
            alive = 0
            for pid, created in started.items():
                try:
                    p = psutil.Process(pid)
                    alive += p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    pass
            return alive

        while running() and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        cleaned = time.monotonic() - t0
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        declared = time.monotonic() - t0
        placement = sorted(pool.placement().values())
    return {"error": error.split(" (")[0], "processes_of_the_lost_actor": len(started),
            "seconds_to_the_episodes_error_and_replacement": round(replaced, 2),
            "seconds_until_none_of_them_runs": round(cleaned, 2), "left_running": running(),
            "seconds_until_ray_counts_the_node_dead": round(declared, 2), "actors_per_node_after": placement}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per arm")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="run in the order given")
    parser.add_argument("--small", action="store_true", help="the tiny model, short episodes, one timed step")
    parser.add_argument("--calls", type=int, default=200, help="environment calls timed for the round trip")
    parser.add_argument("--out", type=Path, default=None, help="result directory (default benchmarks/results)")
    args = parser.parse_args(argv)

    os.chdir(REPO)
    from arpo_lib.workflows.prepare import ensure_prebuilt_model

    model, overrides = SIZES["small" if args.small else "full"]
    steps = 1 if args.small else args.steps
    ensure_prebuilt_model(model)
    work = Path(tempfile.mkdtemp(prefix="bench-ray-cluster-"))
    rows: list[dict[str, Any]] = []
    round_trips: dict[str, float] = {}
    lost: dict[str, Any] = {}
    try:
        # The cluster is up for every arm (its idle raylets cost the local arms what they cost the
        # others), and each local arm runs right before its cluster twin: what else runs on the
        # machine changes less between the two.
        with EnvCluster() as env_cluster:
            round_trips = call_round_trips(args.calls)
            for name in args.arms:
                print(f"[bench_ray_cluster] {name} ...", flush=True)
                rows.append(run_arm(name, model, overrides, steps, work / "runs"))
            print("[bench_ray_cluster] a node lost ...", flush=True)
            lost = node_loss(env_cluster)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_arm = {r["arm"]: r for r in rows}
    ratios = {schedule: by_arm[f"cluster_{schedule}"]["steps_per_hour"] / by_arm[f"local_{schedule}"]["steps_per_hour"]
              for schedule in ("lockstep", "async")
              if f"cluster_{schedule}" in by_arm and f"local_{schedule}" in by_arm}
    result = {
        "benchmark": "ray_cluster", "config": CONFIG, "model": model, "overrides": [*COMMON, *overrides],
        "steps": steps,
        "command": "python benchmarks/bench_ray_cluster.py " + " ".join(command_args(argv)),
        "machine": f"{os.cpu_count()} CPUs: the trainer, the hf server and every node share them",
        "cluster": f"a head (no env_slot) and 2 worker nodes of {SLOTS} env_slots, ray.cluster_utils.Cluster",
        "arms": rows, "cluster_over_local_steps_per_hour": ratios, "call_round_trip": round_trips,
        "node_loss": lost,
    }
    name = "ray_cluster_small" if args.small else "ray_cluster"
    path = write_result(name, result, args.out)
    print(table(rows, ["arm", "steps", "wall_s", "steps_per_hour", "env_busy_fraction", "env_seconds_per_step",
                       "seconds_rollout",
                       "seconds_update", "env_errors", "actors_per_node", "cpu_idle_fraction", "load_average_1min"]))
    print(f"round trip of an empty environment call: {round_trips}")
    print(f"a node lost: {lost}")
    print(f"[bench_ray_cluster] -> {path}")
    return result


if __name__ == "__main__":
    main()
