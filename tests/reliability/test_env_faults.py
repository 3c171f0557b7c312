"""Fault injection: real browsers are killed or frozen at random moments of real rollouts.

The oracle is the scripted agent, which solves every episode of these tasks (tests/agent/test_scripted.py).
So an episode that comes back `ok` but failed can only be an infrastructure fault scored as a policy
failure: the one outcome that must never happen. Every batch must complete, and every fault that
hit an episode must show up as `env_error`, excluded from success statistics and from groups.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import psutil
import pytest

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.evaluation.evaluate import summarize
from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest
from arpo_lib.agent.scripted import ScriptedPolicy

pytestmark = pytest.mark.slow

TASKS = ["miniwob/login-user", "miniwob/enter-text", "miniwob/click-checkboxes"]
TIMEOUT_S = 10.0  # the worker timeout: a frozen browser is declared dead after this


def _browser_processes(pool: EnvPool) -> list[tuple[int, psutil.Process]]:
    """(worker index, process) for every chromium/chromedriver process under the pool's workers."""
    found = []
    for w, worker in enumerate(pool.workers):
        try:
            children = psutil.Process(worker.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if "chrom" in child.name():
                    found.append((w, child))
            except psutil.NoSuchProcess:
                pass
    return found


class FaultInjector(threading.Thread):
    """Every 0.3-2.5 s: SIGKILL a random browser process (the browser, a renderer, the driver), or
    SIGSTOP one (a hang the worker timeout has to catch)."""

    def __init__(self, pool: EnvPool, seed: int, hang_share: float = 0.2):
        super().__init__(daemon=True)
        self.pool, self.rng, self.hang_share = pool, random.Random(seed), hang_share
        self.stop_event = threading.Event()
        self.faults: list[dict] = []

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(0.3, 2.5)):
            procs = _browser_processes(self.pool)
            if not procs:
                continue
            worker, proc = self.rng.choice(procs)
            hang = self.rng.random() < self.hang_share
            try:
                name = proc.name()
                os.kill(proc.pid, signal.SIGSTOP if hang else signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
            self.faults.append({"worker": worker, "process": name, "kind": "hang" if hang else "kill",
                                "time": time.monotonic()})

    def stop(self) -> None:
        self.stop_event.set()
        self.join()


@pytest.fixture(scope="module")
def scripted(tiny_qwen2vl):
    return ScriptedPolicy(HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=32))


def test_random_browser_faults_never_become_policy_failures(scripted, chromium_available, figures, scale):
    batches, per_task = scale(3, 15), scale(3, 4)
    all_trajs, faults = [], []
    with EnvPool(2, {"scale": 2, "max_steps": 12}, timeout_s=TIMEOUT_S) as pool:
        engine = RolloutEngine(scripted, pool, max_steps=12)
        for batch in range(batches):
            requests = [EpisodeRequest(t, 1000 * batch + i, i) for t in TASKS for i in range(per_task)]
            injector = FaultInjector(pool, seed=batch)
            injector.start()
            try:
                trajs = engine.run(requests, temperature=1.0, progress=False)
            finally:
                injector.stop()
            # The batch completed: one trajectory per request, in order.
            assert [(t.task, t.seed) for t in trajs] == [(r.task, r.seed) for r in requests]
            for traj in trajs:
                if traj.status == "ok":
                    assert traj.success and traj.task_score == 1.0, \
                        f"an infrastructure fault was scored as a policy failure: {traj.summary()}"
                else:
                    assert traj.status == "env_error" and traj.error and traj.reward == 0.0
                    assert not traj.success and not traj.segments
            all_trajs += trajs
            faults += injector.faults
            # Frozen browsers not yet noticed (the fault came after the batch's last call) are
            # still in their worker's process group and die with it at the next restart or close.
        restarts = pool.restarts
        groups = {w.process.pid for w in pool.workers}
    # Nothing outlives the pool: no live browser is left in any worker's process group. (Killed
    # ones may linger a moment as zombies until init reaps them: they hold no memory.)
    time.sleep(0.5)
    alive = [p for p in psutil.process_iter(["name", "status"]) if "chrom" in (p.info["name"] or "")
             and p.info["status"] != psutil.STATUS_ZOMBIE and _pgid(p.pid) in groups]
    assert not alive, alive

    errors = [t for t in all_trajs if t.status != "ok"]
    assert faults, "no fault was injected"
    assert errors, "faults were injected but no episode reported an infrastructure failure"
    # Success statistics exclude infrastructure failures: every fresh episode succeeded.
    assert summarize(all_trajs).success_rate == 1.0
    kinds = {}
    for f in faults:
        kinds[f"{f['kind']} {f['process']}"] = kinds.get(f"{f['kind']} {f['process']}", 0) + 1
    causes = {}
    for t in errors:
        cause = ("timeout" if "timed out" in t.error else "worker died" if "worker" in t.error
                 else "browser error")
        causes[cause] = causes.get(cause, 0) + 1
    figures.update(batches=batches, episodes=len(all_trajs), faults_injected=len(faults), fault_kinds=kinds,
                   env_error_episodes=len(errors), env_error_causes=causes,
                   ok_episodes=len(all_trajs) - len(errors),
                   ok_episodes_failed=sum(t.status == "ok" and not t.success for t in all_trajs),
                   worker_restarts=restarts, timeout_s=TIMEOUT_S)


def test_a_frozen_browser_times_out_and_its_worker_is_replaced(scripted, chromium_available, figures):
    """Freeze every browser process of worker 0 between two episodes: the next call on that
    worker must time out, the worker is restarted, and later episodes there succeed."""
    frozen = []

    def freeze(traj):
        if not frozen:
            for w, proc in _browser_processes(pool):
                if w == 0:
                    os.kill(proc.pid, signal.SIGSTOP)
                    frozen.append(proc.pid)

    with EnvPool(1, {"scale": 2, "max_steps": 12}, timeout_s=5.0) as pool:
        engine = RolloutEngine(scripted, pool, max_steps=12)
        requests = [EpisodeRequest("miniwob/enter-text", 50 + i, i) for i in range(4)]
        start = time.monotonic()
        trajs = engine.run(requests, temperature=1.0, progress=False, on_finish=freeze)
        seconds = time.monotonic() - start
        assert frozen and pool.restarts == 1
    assert trajs[0].success
    assert trajs[1].status == "env_error" and "timed out" in trajs[1].error
    assert all(t.success for t in trajs[2:])
    figures.update(frozen_processes=len(frozen), restarts=1, batch_seconds=round(seconds, 1))


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
