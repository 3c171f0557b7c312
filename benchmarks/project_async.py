"""Asynchronous ARPO at GPU scale, projected from measured parts.

No GPU and no VM fleet ran here, so this is a model, not a measurement: a seeded discrete-event
simulation of ARPO's full run (16 tasks x 8 rollouts = 128 environments, 15 steps, one update per
batch) under the two schedules the trainer has, fed with figures measured elsewhere:

  lockstep + synchronous   (rollout.mode=lockstep, max_staleness=0; ARPO's loop) every tick sends
                           each live episode's action, waits for the slowest environment, then one
                           batched generate; the update starts when the batch is in, the next batch
                           when the update is done.
  async + staleness s      (rollout.mode=async, max_staleness=s) each episode steps and asks the
                           server on its own; batches k+1..k+s start with batch k and take the
                           environments it no longer needs (the oldest batch first); the update of
                           batch k starts when batch k is in and the update before is done.

Inputs (each a flag; defaults and where they come from):
  --step-s LO HI       an environment step, uniform (0.5-2.4 s: OSWorld's tasks on the desktop
                       sandbox with its 1 s pause, benchmarks/results/osworld_sandbox.json and the
                       sandbox's measured range of step times; one environment per machine, as VMs)
  --reset-s LO HI      a reset, uniform (0.4-3 s, same source) ...
  --slow-reset P S     ... except with probability P it takes S (0.05, 21 s: a set-up that opens no window)
  --gen-s              one request's generation on the GPU server (ASSUMED 2.0 s: a 7B response of
                       ~150 tokens at ~75 tokens/s per sequence in a batch, the screenshot prefilled
                       on a prefix-cached context); a lockstep tick's batched generate takes as long
  --update-s           one batch's update (12.7 s x 128 trajectories / 16 GPUs + a 15 s push =
                       117 s: the H100's 7B fwd+bwd of a 15-screenshot trajectory, 9.5 s, plus old
                       log-probs ~1/3 of it, benchmarks/results/update_7b_15shots.json; the push ASSUMED)
  --success P          share of episodes that end early (0.3), their length uniform 3-15 steps;
                       the rest run to the 15-step cap

    python benchmarks/project_async.py                 # writes benchmarks/results/async_projection.json
"""
from __future__ import annotations

import argparse
import heapq
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table, write_result  # noqa: E402


@dataclass(frozen=True)
class Setting:
    envs: int = 128
    episodes_per_batch: int = 128
    max_steps: int = 15
    step_s: tuple[float, float] = (0.5, 2.4)
    reset_s: tuple[float, float] = (0.4, 3.0)
    slow_reset: tuple[float, float] = (0.05, 21.0)
    gen_s: float = 2.0
    update_s: float = 117.0
    success: float = 0.3
    batches: int = 20


def episodes(setting: Setting, rng: random.Random) -> list[tuple[float, list[float]]]:
    """One batch's episodes: (reset seconds, each step's environment seconds)."""
    out = []
    for _ in range(setting.episodes_per_batch):
        p, slow = setting.slow_reset
        reset = slow if rng.random() < p else rng.uniform(*setting.reset_s)
        length = rng.randint(3, setting.max_steps) if rng.random() < setting.success else setting.max_steps
        out.append((reset, [rng.uniform(*setting.step_s) for _ in range(length)]))
    return out


def lockstep(setting: Setting, batches: list[list[tuple[float, list[float]]]]) -> dict[str, float]:
    """ARPO's loop: ticks over the batch (at most `envs` episodes live), then the update."""
    clock = busy = 0.0
    for batch in batches:
        queue = list(batch)
        live: list[list[Any]] = []  # [steps left]
        while queue or live:
            # idle environments reset their next episode this tick (a tick waits for the slowest)
            starting = [queue.pop(0) for _ in range(min(len(queue), setting.envs - len(live)))]
            tick = max((r for r, _ in starting), default=0.0)
            busy += sum(r for r, _ in starting)
            live += [list(steps) for _, steps in starting]
            clock += tick
            clock += setting.gen_s  # one batched generate for every live episode
            step_times = [steps.pop(0) for steps in live]
            clock += max(step_times)
            busy += sum(step_times)
            live = [steps for steps in live if steps]
        clock += setting.update_s
    return {"wall_s": clock, "env_busy_s": busy}


def asynchronous(setting: Setting, batches: list[list[tuple[float, list[float]]]], staleness: int) -> dict[str, float]:
    """Episodes on their own; batches k+1..k+s released when train step k starts (when update k-1
    is done); an idle environment takes the next episode of the oldest released batch; update k
    starts when batch k is in and update k-1 is done."""
    n = len(batches)
    queues = [list(b) for b in batches]
    done = [0.0] * n
    release = {k: 0.0 for k in range(min(1 + staleness, n))}
    update_end: list[float] = []

    def next_update() -> None:  # batch len(update_end) is all assigned: its update, the release it brings
        j = len(update_end)
        update_end.append(max(done[j], update_end[-1] if update_end else 0.0) + setting.update_s)
        if j + 1 + staleness < n:
            release[j + 1 + staleness] = update_end[j]

    free = [(0.0, e) for e in range(setting.envs)]
    busy = 0.0
    while any(queues):
        t, env = heapq.heappop(free)
        known = [k for k in sorted(release) if queues[k]]
        while not known:  # every released batch has started all its episodes: the trainer releases more
            next_update()
            known = [k for k in sorted(release) if queues[k]]
        ready = [k for k in known if release[k] <= t]
        k = ready[0] if ready else known[0]
        start = max(t, release[k])
        reset, steps = queues[k].pop(0)
        end = start + reset + sum(s + setting.gen_s for s in steps)
        busy += reset + sum(steps)
        done[k] = max(done[k], end)
        heapq.heappush(free, (end, env))
    while len(update_end) < n:
        next_update()
    return {"wall_s": update_end[-1], "env_busy_s": busy}


def project(setting: Setting, seed: int = 0, staleness: tuple[int, ...] = (1, 2)) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    batches = [episodes(setting, rng) for _ in range(setting.batches)]
    rows = []
    for name, result in [("lockstep", lockstep(setting, batches)),
                         *((f"async_s{s}", asynchronous(setting, batches, s)) for s in staleness)]:
        wall = result["wall_s"]
        rows.append({"arm": name, "steps": setting.batches, "wall_s": round(wall, 1),
                     "steps_per_hour": 3600 * setting.batches / wall,
                     "env_busy_fraction": result["env_busy_s"] / (setting.envs * wall)})
    base = rows[0]["steps_per_hour"]
    for row in rows:
        row["steps_per_hour_ratio"] = row["steps_per_hour"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Setting()
    parser.add_argument("--envs", type=int, default=d.envs)
    parser.add_argument("--episodes", type=int, default=d.episodes_per_batch)
    parser.add_argument("--step-s", type=float, nargs=2, default=d.step_s)
    parser.add_argument("--reset-s", type=float, nargs=2, default=d.reset_s)
    parser.add_argument("--slow-reset", type=float, nargs=2, default=d.slow_reset)
    parser.add_argument("--gen-s", type=float, default=d.gen_s)
    parser.add_argument("--update-s", type=float, default=d.update_s)
    parser.add_argument("--success", type=float, default=d.success)
    parser.add_argument("--batches", type=int, default=d.batches)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="result directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    setting = Setting(envs=args.envs, episodes_per_batch=args.episodes, step_s=tuple(args.step_s),
                      reset_s=tuple(args.reset_s), slow_reset=tuple(args.slow_reset), gen_s=args.gen_s,
                      update_s=args.update_s, success=args.success, batches=args.batches)
    rows = project(setting, args.seed)
    # the same with an update as short as a batch's rollouts: where the schedule, not the trainer, decides
    short = Setting(**{**asdict(setting), "update_s": 30.0})
    short_rows = project(short, args.seed)
    result = {"benchmark": "async_projection", "kind": "a simulation from measured parts, not a measurement",
              "setting": asdict(setting), "arms": rows, "with_a_30s_update": short_rows,
              "steps_per_hour_ratio": {r["arm"]: r["steps_per_hour_ratio"] for r in rows[1:]},
              "env_busy_fraction": {r["arm"]: r["env_busy_fraction"] for r in rows},
              "command": "python benchmarks/project_async.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = write_result("async_projection", result, args.out)
    columns = ["arm", "steps", "wall_s", "steps_per_hour", "steps_per_hour_ratio", "env_busy_fraction"]
    print(table(rows, columns))
    print("with a 30 s update:")
    print(table(short_rows, columns))
    print(f"[project_async] -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
