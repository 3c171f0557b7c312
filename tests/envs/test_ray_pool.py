"""Environment workers as Ray actors (`RayEnvPool`), checked against the local `EnvPool`.

One local Ray session for the module, started by the first pool (which must shut it down again);
the scripted agent drives real MiniWoB episodes through the real rollout engine on both backends.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.pool import EnvPool, make_pool
from arpo_lib.envs.workers.worker import EnvSetupError
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest

OPTIONS = {"scale": 2, "max_steps": 3}
TASKS = ["miniwob/click-test", "miniwob/click-button"]


def _requests(n: int = 2, first_seed: int = 11) -> list[EpisodeRequest]:
    return [EpisodeRequest(t, first_seed + i, i) for t in TASKS for i in range(n)]


# ---- configuration errors: no Ray needed ---------------------------------------------------------

def test_make_pool_refuses_ray_options_for_the_local_backend():
    with pytest.raises(ValueError, match="ray_resource only apply to backend='ray'"):
        make_pool(1, {}, backend="local", ray_resource="env_slot")
    with pytest.raises(ValueError, match="unknown environment backend 'k8s'"):
        make_pool(1, {}, backend="k8s")


def test_make_pool_local_is_an_env_pool():
    with make_pool(1, {}, 30) as pool:
        assert isinstance(pool, EnvPool) and pool.workers[0].call("ping")["pid"] > 0


# ---- on Ray ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_pool(chromium_available):
    """Two environment actors; this pool starts the module's Ray (with 2 `env_slot`s) and stops it."""
    ray = pytest.importorskip("ray")
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    pool = RayEnvPool(2, OPTIONS, timeout_s=60, cache_size=2, init_kwargs={"resources": {"env_slot": 2}})
    assert pool.started_ray
    yield pool
    pool.close()
    assert not ray.is_initialized(), "a pool that started Ray must shut it down"


@pytest.fixture(scope="module")
def scripted(tiny_qwen2vl):
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.agent.scripted import ScriptedPolicy

    return ScriptedPolicy(HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=32))


def _record(trajs) -> list[tuple]:
    """What must not depend on the backend: scores, steps, actions, responses and every screen."""
    from PIL import Image

    rows = []
    for t in trajs:
        screens = sorted(Path(t.directory).glob("step_*.png"))
        pixels = [hashlib.sha256(Image.open(p).convert("RGB").tobytes()).hexdigest() for p in screens]
        rows.append((t.task, t.seed, t.status, t.task_score, t.reward, t.num_steps,
                     [s.actions for s in t.steps], [s.response for s in t.steps], pixels,
                     [seg.input_ids for seg in t.segments]))
    return rows


@pytest.mark.slow
def test_ray_actors_give_the_same_episodes_as_local_workers(ray_pool, scripted, tmp_path):
    requests = _requests()
    with EnvPool(2, OPTIONS, timeout_s=60, cache_size=2) as local:
        expected = RolloutEngine(scripted, local, max_steps=3).run(requests, out_dir=tmp_path / "local",
                                                                   progress=False)
    got = RolloutEngine(scripted, ray_pool, max_steps=3).run(requests, out_dir=tmp_path / "ray", progress=False)
    assert all(t.status == "ok" and t.task_score == 1.0 for t in expected), [t.summary() for t in expected]
    assert _record(got) == _record(expected)


@pytest.mark.slow
def test_killed_actor_is_an_env_error_and_the_pool_recovers(ray_pool, scripted):
    import ray

    engine = RolloutEngine(scripted, ray_pool, max_steps=3)
    killed = []

    def kill_actor(traj):
        if not killed:
            w = ray_pool.workers[0]
            killed.append(w.ping()["worker_pid"])  # (queued behind a call in flight, if any)
            ray.kill(w.actor)  # the next command to worker 0 meets a dead actor

    restarts = ray_pool.restarts
    trajs = engine.run(_requests(3, first_seed=40), progress=False, on_finish=kill_actor)
    assert len(trajs) == 6
    errors = [t for t in trajs if t.status == "env_error"]
    assert len(errors) == 1 and "actor died" in errors[0].error and errors[0].reward == 0.0
    assert all(t.success for t in trajs if t.status == "ok")
    assert ray_pool.restarts == restarts + 1
    # The dead actor's worker (and its browser) follow it: see worker._exit_with_parent.
    assert _exits(killed[0], within_s=5), "the killed actor's worker outlived it"
    again = engine.run(_requests(1, first_seed=60), progress=False)
    assert all(t.success for t in again)


@pytest.mark.slow
def test_an_actor_that_does_not_answer_is_replaced(ray_pool):
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    with RayEnvPool(1, {}, timeout_s=1.0, call_margin_s=1.0, num_cpus=0) as pool:
        worker = pool.workers[0]
        stuck = worker.ping()
        os.kill(stuck["pid"], signal.SIGSTOP)  # the actor itself hangs, not its worker
        start = time.monotonic()
        with pytest.raises(EnvError, match="actor call timed out after 2 s"):
            worker.call("ping")
        assert time.monotonic() - start < 10 and pool.restarts == 1
        assert worker.ping()["pid"] != stuck["pid"]
        assert worker.call("ping")["pid"] != stuck["worker_pid"]
    assert _exits(stuck["pid"], within_s=10) and _exits(stuck["worker_pid"], within_s=5)


@pytest.mark.slow
def test_actors_are_placed_on_the_custom_resource(ray_pool):
    import ray

    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    with make_pool(2, {}, 30, backend="ray", ray_resource="env_slot", ray_num_cpus=0) as pool:
        assert isinstance(pool, RayEnvPool) and len(pool) == 2
        assert _eventually(lambda: ray.available_resources().get("env_slot", 0) == 0)  # both slots taken
        assert {w.ping()["node_id"] for w in pool.workers} == {ray.get_runtime_context().get_node_id()}
        assert all(w.call("ping")["torch_loaded"] is False for w in pool.workers)
    # A third environment has no slot: a clear error after the bounded wait, never a hang.
    start = time.monotonic()
    with pytest.raises(EnvSetupError, match=r"(?s)not placed within 3 s.*'vm_slot': 1.*--resources"):
        RayEnvPool(1, {}, resource="vm_slot", num_cpus=0, placement_timeout_s=3)
    assert time.monotonic() - start < 10
    assert not pool.started_ray and ray.is_initialized()  # pools that joined Ray leave it running


@pytest.mark.slow
def test_an_actor_whose_worker_cannot_start_is_a_setup_error(ray_pool):
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    with pytest.raises(EnvSetupError, match="could not start its worker: .*'/nonexistent/python' does not exist"):
        RayEnvPool(1, {}, python="/nonexistent/python", num_cpus=0, placement_timeout_s=30)


def _eventually(check, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _exits(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_config_env_backend_ray_builds_actors_through_the_trainer_factory(ray_pool):
    """`env.backend=ray` (+ `env.ray_resource`) in a run config gives Ray actors; the pool joins
    the Ray that is already running and leaves it running."""
    import ray

    from arpo_lib.run.config import load_config
    from arpo_lib.envs.workers.ray_pool import RayEnvPool
    from arpo_lib.build import env_pool as pool_for

    cfg = load_config(None, ["env.backend=ray", "env.workers=1", "env.ray_resource=env_slot",
                             "env.ray_num_cpus=0", "env.options={scale: 2}"])
    with pool_for(cfg) as pool:
        assert isinstance(pool, RayEnvPool) and not pool.started_ray
        obs, info = pool.workers[0].call("reset", ("miniwob/click-test", 3))
        assert obs.screenshot.size == (320, 420) and obs.instruction
    assert ray.is_initialized()


@pytest.mark.slow
def test_ray_actors_import_the_runs_plugins(ray_pool):
    """An actor's worker makes a family that only a plug-in registers (the pool joins the running Ray)."""
    from arpo_lib.envs.workers.ray_pool import RayEnvPool

    with RayEnvPool(1, {"max_steps": 2}, timeout_s=60, num_cpus=0, plugins=["tests.plugins.example_plugin"]) as pool:
        assert not pool.started_ray
        obs, info = pool.workers[0].call("reset", ("example/click-box@3", 0))
        assert obs.instruction == "Click the red box." and info["box"]


@pytest.mark.slow
def test_async_rollouts_over_ray_actors_and_batches_sharing_them_give_the_lockstep_episodes(ray_pool, scripted,
                                                                                             tmp_path):
    """rollout.mode=async over Ray actors (a worker says it has answered through its pending Ray
    reference, `ready()`), with two batches sharing the actors at once (`SharedWorkers`, as
    rollout.max_staleness runs them): every episode is the one lockstep plays."""
    import threading

    from arpo_lib.rollout.engine import SharedWorkers

    expected = RolloutEngine(scripted, ray_pool, max_steps=3).run(_requests(), out_dir=tmp_path / "lockstep",
                                                                   progress=False)
    shared, ahead = SharedWorkers(), {}
    shared.want(0, True)

    def play_ahead() -> None:
        engine = RolloutEngine(scripted, ray_pool, max_steps=3, mode="async", shared=shared, batch=1)
        ahead["trajs"] = engine.run(_requests(), out_dir=tmp_path / "batch1", progress=False)

    thread = threading.Thread(target=play_ahead)
    thread.start()
    first = RolloutEngine(scripted, ray_pool, max_steps=3, mode="async", shared=shared, batch=0).run(
        _requests(), out_dir=tmp_path / "batch0", progress=False)
    thread.join(180)
    assert all(t.status == "ok" and t.task_score == 1.0 for t in expected), [t.summary() for t in expected]
    assert _record(first) == _record(expected) == _record(ahead["trajs"])
