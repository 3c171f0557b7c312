"""Environment actors on a Ray cluster of several nodes (`RayEnvPool` with `env.ray_resource`).

Ray's own `ray.cluster_utils.Cluster` starts, on this machine, a head that offers no environments
and two worker nodes offering `env_slot`s: each node a raylet of its own, as on separate machines,
so every actor reports the node it runs on and a node can be removed (its raylet killed) while
its episodes run. The episodes are real MiniWoB++ browsers and sandbox desktops driven by the real
rollout engine and trainer; what a node's loss leaves behind is read from the process table.

What this cannot show: a network between the nodes (they share this machine's loopback and its
two cores), and a machine that vanishes whole (here its raylet dies and Ray's processes follow).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.base import NODE_LOST
from arpo_lib.envs.workers.worker import EnvSetupError
from arpo_lib.rollout.engine import RolloutEngine, SharedWorkers
from arpo_lib.types import EpisodeRequest

SLOTS = 4
"""`env_slot`s each worker node offers: room for a pool of 4 spread 2 + 2 to move onto one node."""
TASKS = ["miniwob/click-test", "miniwob/click-button"]
OPTIONS = {"scale": 2, "max_steps": 3}
NODE_MEMORY = {"object_store_memory": 80 * 2**20}


@dataclass
class EnvCluster:
    """The module's cluster: the head (no `env_slot`) and the worker nodes now alive."""

    cluster: Any
    nodes: list[Any] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def add(self) -> Any:
        node = self.cluster.add_node(num_cpus=2, resources={"env_slot": SLOTS}, **NODE_MEMORY)
        self.nodes.append(node)
        return node

    def remove(self, node_id: str) -> None:
        """Kill the node's raylet (and Ray's processes there) without warning, as a lost machine."""
        node = self.node(node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        self.removed.append(node_id)

    def settle(self, within_s: float = 90) -> None:
        """Wait until Ray's control store marks every removed node dead (its health check takes some
        seconds): a test started before that could have actors placed on a node that is gone."""
        import ray

        deadline = time.monotonic() + within_s
        while self.removed and time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            self.removed = [n for n in self.removed if n in alive]
            if self.removed:
                time.sleep(0.5)
        assert not self.removed, f"Ray still lists the removed node(s) {self.removed} alive after {within_s} s"

    def node(self, node_id: str) -> Any:
        return next(n for n in self.nodes if n.node_id == node_id)

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def restore(self, count: int = 2) -> None:
        """Back to `count` worker nodes, waiting until Ray lists them alive and the removed ones dead."""
        while len(self.nodes) < count:
            self.add()
        self.settle()


@pytest.fixture(scope="module")
def env_cluster(chromium_available):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # a session another module left open: this module needs its own driver
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"env_slot": 0},
                                                            "include_dashboard": False, **NODE_MEMORY})
    envs = EnvCluster(cluster)
    try:
        envs.restore()
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        yield envs
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def two_worker_nodes(request):
    """Every test starts on two worker nodes (one that removed a node adds one back)."""
    if "env_cluster" in request.fixturenames:
        request.getfixturevalue("env_cluster").restore()


@pytest.fixture(scope="module")
def scripted(tiny_qwen2vl):
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.agent.scripted import ScriptedPolicy

    return ScriptedPolicy(HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=32))


def _requests(n: int = 2, first_seed: int = 11) -> list[EpisodeRequest]:
    return [EpisodeRequest(t, first_seed + i, i) for t in TASKS for i in range(n)]


def _ray_pool(n: int, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    return RayEnvPool(n, OPTIONS if options is None else options, timeout_s=60, cache_size=2, resource="env_slot",
                      num_cpus=0, **kwargs)


def _processes(pids: list[int]) -> dict[int, tuple[str, float]]:
    """These processes and all they started: pid -> (name, start time)."""
    found = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = (p.name(), p.create_time())
        except psutil.NoSuchProcess:
            continue
    return found


def _left(processes: dict[int, tuple[str, float]], within_s: float) -> list[str]:
    """Those of `processes` still running (not zombies) after waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for pid, (name, started) in processes.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {name}")
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---- placement ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_actors_go_only_to_the_nodes_offering_slots_and_spread_over_them(env_cluster):
    import ray

    with _ray_pool(4, {}) as pool:
        facts = [w.ping() for w in pool.workers]
        nodes = {n.node_id for n in env_cluster.nodes}
        assert sorted(pool.placement().values()) == [2, 2] and set(pool.placement()) == nodes
        assert [f["node_id"] for f in facts] == [w.node_id for w in pool.workers]
        assert env_cluster.head_id not in pool.placement()  # the head offers no env_slot
        assert all(w.call("ping")["pid"] == f["worker_pid"] for w, f in zip(pool.workers, facts))
        free = {n["NodeID"]: n for n in ray.nodes()}
        assert all(free[node]["Resources"]["env_slot"] == SLOTS for node in nodes)


# ---- an ARPO step over the cluster -------------------------------------------------------------

def _cfg(tmp_path: Path, model: Path, name: str, *overrides: str) -> Any:
    from arpo_lib.run.config import load_config

    return load_config("configs/smoke.yaml", [
        f"model.path={model}", f"out_dir={tmp_path}", f"name={name}", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=4", "env.max_steps=2", "model.max_new_tokens=32", "rollout.group_size=2",
        "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=1", "train.lr=3e-3",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0", "logging.progress=false",
        *overrides])


ON_RAY = ("env.backend=ray", "env.ray_resource=env_slot", "env.ray_num_cpus=0")


def _episodes(run: Path, step: int = 0) -> list[tuple]:
    """A step's episodes as stored: what must not depend on where the environments ran."""
    from PIL import Image

    from arpo_lib.rollout.store import read_trajectory, trajectory_dirs

    root = run / "rollouts" / f"step_{step:06d}"
    rows = []
    for directory in trajectory_dirs(root):
        t = read_trajectory(directory, tokens=True).trajectory
        pixels = [hashlib.sha256(Image.open(p).convert("RGB").tobytes()).hexdigest()
                  for p in sorted(directory.glob("step_*.png"))]
        rows.append((str(directory.relative_to(root)), t.status.value, t.task_score, t.reward,
                     [s.actions for s in t.steps], [s.response for s in t.steps], pixels,
                     [seg.input_ids for seg in t.segments]))
    return rows


def _one_step(cfg: Any) -> dict[str, Any]:
    from arpo_lib import build

    with build.trainer(cfg) as trainer:
        (metrics,) = trainer.train()
        if cfg.env.backend == "ray":
            placement = trainer.rollouts.pool.placement()
            metrics["placement"] = sorted(placement.values())
    return metrics


@pytest.fixture(scope="module")
def local_step(warm_tiny_qwen2vl, tmp_path_factory):
    """The reference: one ARPO step on 4 local worker processes."""
    out = tmp_path_factory.mktemp("local")
    metrics = _one_step(_cfg(out, warm_tiny_qwen2vl, "local"))
    return metrics, _episodes(out / "local")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lockstep", pytest.param("async", marks=pytest.mark.long)])
def test_an_arpo_step_over_the_cluster_gives_the_episodes_of_local_workers(env_cluster, local_step,
                                                                            warm_tiny_qwen2vl, tmp_path, mode):
    """The same step with its 4 environments as actors spread over the two worker nodes: the same
    episodes (actions, responses, every screen, every token), rewards and update. (Async in CI:
    the batches sharing the actors below, and tests/rollout/test_engine_async.py's tokens.)"""
    expected_metrics, expected = local_step
    metrics = _one_step(_cfg(tmp_path, warm_tiny_qwen2vl, "ray", *ON_RAY, f"rollout.mode={mode}"))
    assert metrics["placement"] == [2, 2]
    assert _episodes(tmp_path / "ray") == expected
    assert any(row[1] == "ok" and row[4] for row in expected)  # the warm model acts
    for key in ("success_rate", "mean_reward", "env_errors", "replay_injections", "mean_steps"):
        assert metrics[key] == expected_metrics[key], key
    assert metrics["env_errors"] == 0 and metrics["env_error_causes"] == {}
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_batches_sharing_the_actors_of_two_nodes_give_the_lockstep_episodes(env_cluster, scripted, tmp_path):
    """rollout.mode=async with a second batch playing at once on the same actors (`SharedWorkers`,
    as rollout.max_staleness runs them), the actors on two nodes: every episode is the one
    lockstep plays."""
    from tests.envs.test_ray_pool import _record

    with _ray_pool(4) as pool:
        assert sorted(pool.placement().values()) == [2, 2]
        expected = RolloutEngine(scripted, pool, max_steps=3).run(_requests(), out_dir=tmp_path / "lockstep",
                                                                  progress=False)
        shared, ahead = SharedWorkers(), {}
        shared.want(0, True)

        def play_ahead() -> None:
            engine = RolloutEngine(scripted, pool, max_steps=3, mode="async", shared=shared, batch=1)
            ahead["trajs"] = engine.run(_requests(first_seed=21), out_dir=tmp_path / "batch1", progress=False)

        thread = threading.Thread(target=play_ahead)
        thread.start()
        first = RolloutEngine(scripted, pool, max_steps=3, mode="async", shared=shared, batch=0).run(
            _requests(), out_dir=tmp_path / "batch0", progress=False)
        thread.join(180)
        second = RolloutEngine(scripted, pool, max_steps=3).run(_requests(first_seed=21), out_dir=tmp_path / "l2",
                                                                progress=False)
    assert all(t.status == "ok" and t.task_score == 1.0 for t in expected + second)
    assert _record(first) == _record(expected) and _record(ahead["trajs"]) == _record(second)


@pytest.mark.slow
@pytest.mark.long
def test_batches_ahead_play_on_the_actors_of_both_nodes_during_the_update(env_cluster, warm_tiny_qwen2vl, tmp_path):
    """Asynchronous ARPO on the cluster (rollout.mode=async, rollout.max_staleness=1, our hf
    server): batch 2 starts on the actors batch 1 no longer needs and plays through its update;
    every episode of both batches ran on an actor of one of the two worker nodes, none was lost."""
    from arpo_lib import build

    cfg = _cfg(tmp_path, warm_tiny_qwen2vl, "ahead", *ON_RAY, "train.steps=2", "rollout.backend=server",
               "rollout.weight_sync=restart", "serve.backend=hf", "rollout.max_staleness=1", "rollout.mode=async")
    with build.trainer(cfg) as trainer:
        pool = trainer.rollouts.pool
        update, seen_ahead = trainer.update, []

        def spied(groups):
            seen_ahead.append(sorted(trainer.rollouts._ahead))
            return update(groups)

        trainer.update = spied
        history = trainer.train()
        placement = pool.placement()
    assert seen_ahead == [[1], []]
    assert sorted(placement.values()) == [2, 2] and set(placement) == {n.node_id for n in env_cluster.nodes}
    assert [m["env_errors"] for m in history] == [0, 0] and history[1]["staleness_max"] <= 1.0
    for step in (0, 1):
        assert len(list((tmp_path / "ahead" / "rollouts" / f"step_{step:06d}").rglob("meta.json"))) == 4


# ---- a node lost mid-run -----------------------------------------------------------------------

def _lose_a_node_at_the_first_generation(trainer: Any, env_cluster: EnvCluster, snapshot: dict[str, Any]) -> None:
    """Make the trainer's first generation remove the node of its first environment (its episodes
    running), after noting in `snapshot` the node and every process of its environments."""
    pool, generate = trainer.rollouts.pool, trainer.policy.generate

    def generate_and_lose_a_node(*args: Any, **kwargs: Any) -> Any:
        if not snapshot:
            lost = pool.workers[0].node_id
            pids = [w.ping()["pid"] for w in pool.workers if w.node_id == lost]
            snapshot.update(node=lost, processes=_processes(pids))
            env_cluster.remove(lost)
        return generate(*args, **kwargs)

    trainer.policy.generate = generate_and_lose_a_node


@pytest.mark.slow
def test_a_node_lost_mid_step_loses_its_episodes_and_a_node_added_back_takes_the_next_batch(
        env_cluster, warm_tiny_qwen2vl, tmp_path):
    """A worker node removed while its two episodes run (at the batch's first generation): those
    two are infrastructure failures, counted as `node_lost` in metrics.jsonl and named in their
    meta.json, dropped from their groups; the pool replaces the two actors on the node left and
    the step completes. Nothing of the lost node's environments (actors, workers, browsers,
    drivers) is left running. A node added during the update takes two actors at the next
    batch's resets, and that batch loses nothing."""
    from arpo_lib import build
    from arpo_lib.run.layout import read_groups
    from arpo_lib.run.records import read_jsonl

    cfg = _cfg(tmp_path, warm_tiny_qwen2vl, "lost", *ON_RAY, "rollout.group_size=3", "train.steps=2")
    snapshot: dict[str, Any] = {}
    with build.trainer(cfg) as trainer:
        pool = trainer.rollouts.pool
        update = trainer.update
        _lose_a_node_at_the_first_generation(trainer, env_cluster, snapshot)

        def update_and_add_a_node(groups):
            if "added" not in snapshot:
                snapshot["added"] = env_cluster.add().node_id
            return update(groups)

        trainer.update = update_and_add_a_node
        first = trainer.train(steps=1)[0]
        after_loss = pool.placement()
        second = trainer.train(steps=1)[0]
        after_join = pool.placement()
        moves = sum(w.moves for w in pool.workers)

    names = {name for name, _ in snapshot["processes"].values()}
    assert "chromedriver" in names and any(n.startswith("chromium") for n in names), names
    assert _left(snapshot["processes"], within_s=15) == []
    assert first["env_errors"] == 2 and first["env_error_causes"] == {"node_lost": 2}
    assert snapshot["node"] not in after_loss and list(after_loss.values()) == [4]  # replaced on the node left
    logged = read_jsonl(tmp_path / "lost" / "metrics.jsonl")
    assert [m["env_error_causes"] for m in logged] == [{"node_lost": 2}, {}]
    step = tmp_path / "lost" / "rollouts" / "step_000000"
    metas = {p.parent: json.loads(p.read_text()) for p in step.rglob("meta.json")}
    lost = {d: m["error"] for d, m in metas.items() if m["status"] == "env_error"}
    assert len(metas) == 6 and len(lost) == 2
    assert all(e.startswith(f"{NODE_LOST}: node {snapshot['node']} left the cluster") for e in lost.values())
    trained_on = {Path(m["dir"]) for g in read_groups(step / "groups.json") for m in g["members"]}
    assert trained_on and not trained_on & set(lost)  # dropped from their groups
    assert second["env_errors"] == 0 and moves == 2
    assert sorted(after_join.values()) == [2, 2] and after_join.get(snapshot["added"]) == 2


@pytest.mark.slow
def test_an_arpo_step_over_sandbox_desktops_on_two_nodes_survives_losing_one(env_cluster, warm_tiny_qwen2vl,
                                                                             tmp_path):
    """One ARPO step over sandbox desktops (the openbox desktop, two desktop tasks x 2 rollouts)
    spread over the two worker nodes; one node removed at the batch's first generation: its two
    episodes are infrastructure failures counted as `node_lost` and kept out of their groups, the
    step completes on the desktops of the node left, and nothing of the lost node's desktops runs
    on (X server, bubblewrap, window manager, the tasks' applications, the sandbox's server)."""
    from arpo_lib import build
    from arpo_lib.run.layout import read_groups
    from arpo_lib.run.records import read_jsonl

    from tests.envs.desktop.test_desktop import REASON

    if REASON is not None:
        pytest.fail(f"the desktop sandbox cannot run here: {REASON} (./workbench setup installs it)")
    cfg = _cfg(tmp_path, warm_tiny_qwen2vl, "desktops", *ON_RAY, "env.tasks=[desktop/terminal-mkdir,desktop/editor-clear]",
               "env.options={screen: [960, 600], settle_s: 0.2}")
    snapshot: dict[str, Any] = {}
    with build.trainer(cfg) as trainer:
        _lose_a_node_at_the_first_generation(trainer, env_cluster, snapshot)
        (metrics,) = trainer.train(steps=1)

    names = {name for name, _ in snapshot["processes"].values()}
    assert {"bwrap", "Xvfb", "openbox"} <= names, names
    assert _left(snapshot["processes"], within_s=20) == []
    assert metrics["env_errors"] == 2 and metrics["env_error_causes"] == {"node_lost": 2}
    assert [m["env_error_causes"] for m in read_jsonl(tmp_path / "desktops" / "metrics.jsonl")] == [{"node_lost": 2}]
    step = tmp_path / "desktops" / "rollouts" / "step_000000"
    metas = {p.parent: json.loads(p.read_text()) for p in step.rglob("meta.json")}
    lost = {d for d, m in metas.items() if m["status"] == "env_error"}
    assert len(metas) == 4 and len(lost) == 2
    trained_on = {Path(m["dir"]) for g in read_groups(step / "groups.json") for m in g["members"]}
    assert not trained_on & lost


@pytest.mark.slow
@pytest.mark.long  # the ARPO step over desktops above covers the same in CI
def test_a_desktop_whose_node_is_lost_leaves_no_process_behind(env_cluster, tmp_path):
    """Two sandbox desktops (the openbox desktop and a terminal) spread over the two nodes; one
    node removed while its worker carries out a step: that episode is an EnvError naming the
    node, nothing of its desktop is left (X server, bubblewrap, window manager, the terminal, the
    sandbox's server and watcher), the desktop on the other node goes on, and the lost one is
    replaced there."""
    from arpo_lib.actions import Action
    from arpo_lib.envs.workers.worker import action_payload

    from tests.envs.desktop.test_desktop import REASON

    if REASON is not None:
        pytest.fail(f"the desktop sandbox cannot run here: {REASON} (./workbench setup installs it)")
    with _ray_pool(2, {"screen": [960, 600], "max_steps": 4}) as pool:
        assert sorted(pool.placement().values()) == [1, 1]
        for w in pool.workers:
            obs, _ = w.call("reset", ("desktop/terminal-mkdir", 0))
            assert obs.screenshot.size == (960, 600)
        doomed, kept = pool.workers
        processes = _processes([doomed.ping()["pid"]])
        names = {name for name, _ in processes.values()}
        assert {"bwrap", "Xvfb", "openbox"} <= names and any(n.startswith("st") for n in names), names
        doomed.send("step", action_payload([Action("wait")]))
        lost = doomed.node_id
        env_cluster.remove(lost)
        with pytest.raises(EnvError, match=f"^{NODE_LOST}: node {lost}"):
            doomed.recv()
        assert _left(processes, within_s=20) == []
        kept.send("step", action_payload([Action("wait")]))
        kept.recv()
        assert pool.placement() == {kept.node_id: 2} and doomed.restarts == 1


@pytest.mark.slow
def test_a_run_whose_environment_nodes_are_all_gone_stops_with_a_clear_error(env_cluster, scripted):
    """Both worker nodes removed during a batch: the episodes are lost, no replacement can be
    placed, and the run stops after the bounded placement wait, naming the lost nodes and what to
    do, instead of waiting for a node forever."""
    with _ray_pool(2) as pool:  # started within the usual wait (a loaded machine can take over 5 s)
        pool.placement_timeout_s = 5  # the wait for a replacement, which no node can take
        nodes = sorted(pool.placement())
        assert nodes == sorted(n.node_id for n in env_cluster.nodes), pool.placement()  # one actor on each
        policy_generate = scripted.generate
        removed = []

        class LosingAll:
            def __getattr__(self, name):
                return getattr(scripted, name)

            def generate(self, *args, **kwargs):
                if not removed:
                    processes = _processes([w.ping()["pid"] for w in pool.workers])
                    for node in nodes:
                        env_cluster.remove(node)
                    removed.extend(nodes)
                    # an actor outlives its raylet by a moment (it notices the loss by polling),
                    # and answers direct calls meanwhile: on a busy machine that moment can cover
                    # a whole short episode, which then ends as if no node had gone
                    assert _left(processes, within_s=20) == []
                return policy_generate(*args, **kwargs)

        start = time.monotonic()
        with pytest.raises(EnvSetupError, match=r"(?s)not placed within 5 s.*No node offers env_slot any more") as err:
            RolloutEngine(LosingAll(), pool, max_steps=3).run(_requests(1), progress=False)
        assert time.monotonic() - start < 60
        assert all(node in str(err.value) for node in nodes) and "ray_env_node.sh" in str(err.value)
