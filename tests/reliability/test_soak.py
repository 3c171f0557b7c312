"""Soak: many episodes through the rollout engine with several browsers, bounded in time.

Memory (PSS of this process and every child), open file descriptors and processes are sampled
after each batch. The tasks rotate through more tasks than each worker keeps open, so browsers are
closed and started all the time: leaks in that path show up as growth. After the pool closes,
no worker or browser process is left.
"""
from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.agent.hf_policy import HFPolicy
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.types import EpisodeRequest

pytestmark = pytest.mark.slow

TASKS = ["miniwob/click-test", "miniwob/click-button", "miniwob/enter-text", "miniwob/focus-text"]


def _tree() -> list[psutil.Process]:
    me = psutil.Process(os.getpid())
    return [me] + me.children(recursive=True)


def _sample() -> dict[str, float]:
    pss = fds = procs = 0
    for proc in _tree():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            pss += proc.memory_full_info().pss
            fds += proc.num_fds()
            procs += 1
        except psutil.Error:
            pass
    return {"pss_mb": pss / 2**20, "fds": fds, "procs": procs}


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's helper process, which lives as long as this process by design."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _slope(ys: list[float]) -> float:
    """Least-squares slope per sample."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / max(sum((i - mx) ** 2 for i in range(n)), 1e-9)


def test_soak_no_growth_in_memory_files_or_processes(tiny_qwen2vl, chromium_available, figures, scale):
    budget_s = scale(60, 900)
    warmup_batches = 3
    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=24)
    samples, episodes, batch = [], 0, 0
    start = time.monotonic()
    with EnvPool(2, {"scale": 2, "max_steps": 3}, timeout_s=60, cache_size=1) as pool:
        engine = RolloutEngine(policy, pool, max_steps=3)
        while time.monotonic() - start < budget_s or batch < warmup_batches + 4:
            # Each batch visits every task: with one open browser per worker, most episodes
            # switch task and so close one browser and start another.
            requests = [EpisodeRequest(TASKS[(batch + i) % len(TASKS)], 10_000 + batch * 8 + i, i % 2)
                        for i in range(8)]
            torch.manual_seed(batch)
            trajs = engine.run(requests, progress=False)
            assert all(t.status == "ok" for t in trajs), [t.error for t in trajs if t.error]
            episodes += len(trajs)
            batch += 1
            samples.append(_sample())
        workers = {w.process.pid for w in pool.workers}
        restarts = pool.restarts
    time.sleep(0.5)
    left = [p for p in _tree()[1:] if p.status() != psutil.STATUS_ZOMBIE and not _is_resource_tracker(p)]
    assert not left, f"processes left after the pool closed: {left}"

    steady = samples[warmup_batches:]
    per_100 = 100 / 8  # samples are per batch of 8 episodes
    pss = [s["pss_mb"] for s in steady]
    fds = [s["fds"] for s in steady]
    mb_per_100 = _slope(pss) * per_100
    fds_per_100 = _slope(fds) * per_100
    # No growth: processes come back to the same count after every batch; open files and memory
    # move with what the browsers are doing (sockets, shared memory, caches: tens of descriptors
    # and MB from batch to batch), so the test is on the trend, not on single samples.
    assert max(s["procs"] for s in steady) <= min(s["procs"] for s in steady) + 2
    # A slope over ~10 CI-length samples moving by tens of descriptors is noisy (one run on a busy
    # machine measured 21 from [789, 786, 789, 807, 798, 807, 789, 798, 807, 804]: no trend); a real
    # leak of one descriptor every few episodes is far above either bound.
    fds_bound = scale(40, 20)
    assert fds_per_100 < fds_bound, f"open files grow by {fds_per_100:.2f} per 100 episodes: {fds}"
    assert max(fds) - min(fds) <= 96, fds
    assert mb_per_100 < 25, f"memory grows by {mb_per_100:.1f} MB per 100 episodes: {pss}"
    every = max(1, len(steady) // 40)
    figures.update(seconds_budget=budget_s, batches=batch, episodes=episodes, workers=len(workers),
                   worker_restarts=restarts, pss_mb_first=round(pss[0]), pss_mb_last=round(pss[-1]),
                   pss_mb_min=round(min(pss)), pss_mb_max=round(max(pss)),
                   pss_slope_mb_per_100_episodes=round(mb_per_100, 2),
                   fds_slope_per_100_episodes=round(fds_per_100, 3),
                   pss_mb_series=[round(x) for x in pss[::every]], fds_series=fds[::every],
                   fds_range=[min(s["fds"] for s in steady), max(s["fds"] for s in steady)],
                   procs_range=[min(s["procs"] for s in steady), max(s["procs"] for s in steady)])
