"""Speed and cost of the desktop environments (desktop/<task>): sandbox start, reset (applications
ended, fresh home, the task's set-up), one typed action, one scripted episode, and the memory of a
running sandbox, with 1 and with N environments side by side (threads, one sandbox each).

    python benchmarks/bench_desktop.py                      # 1 and 4 environments, 1920x1080
    python benchmarks/bench_desktop.py --envs 1 2 --screen 960x600
    # as an ordinary user (the system Python with this environment's packages; docs/desktop.md's "ordinary user" rows):
    setpriv --reuid 65534 --regid 65534 --clear-groups env -i PATH=/usr/bin:/bin HOME=/tmp \
        PYTHONPATH=.venv/lib/python3.11/site-packages:. /usr/bin/python3 benchmarks/bench_desktop.py \
        --out /tmp/bench --name desktop_envs_ordinary_user

Writes benchmarks/results/desktop_envs.json. Memory is the resident set (RSS) summed over the
sandbox's processes (bwrap, the action server, Xvfb, the window manager, the application) at the
end of an episode; shared pages are counted once per process, so the sum overstates a little.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arpo_lib.actions import Action  # noqa: E402
from arpo_lib.envs import make_env  # noqa: E402
from arpo_lib.envs.desktop.scripted import solution_actions  # noqa: E402
from benchmarks.common import table, write_result  # noqa: E402

TASKS = ("editor-type-save", "terminal-mkdir", "files-new-folder", "browser-bookmark")
"""One task per application; environment i runs TASKS[i % 4]."""


def _tree_pids(root_pid: int) -> list[int]:
    """`root_pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    pids, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def _tree_memory_mib(root_pid: int, source: str = "status", field: str = "VmRSS:") -> float:
    """A kB figure of /proc/<pid>/<source> summed over the process tree, in MiB (RSS by default;
    source="smaps_rollup", field="Pss:" for the proportional set size)."""
    total = 0
    for pid in _tree_pids(root_pid):
        try:
            with open(f"/proc/{pid}/{source}") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field))
        except (OSError, StopIteration):
            pass
    return total / 1024


def _tree_rss_mib(root_pid: int) -> float:
    return _tree_memory_mib(root_pid)


def one_env(task: str, screen: tuple[int, int], episodes: int, out: dict[str, Any]) -> None:
    t0 = time.monotonic()
    env = make_env(f"desktop/{task}", screen=screen)
    try:
        resets, typed, solved, rewards = [], [], [], []
        for episode in range(episodes):
            t = time.monotonic()
            obs, _ = env.reset()
            resets.append(time.monotonic() - t)
            if episode == 0:
                out["start_s"] = env.timings["start_s"]
            t = time.monotonic()
            for action in solution_actions(task, obs.screenshot.size):
                obs, reward, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    break
            solved.append(time.monotonic() - t)
            rewards.append(reward)
            out["rss_mib"] = _tree_rss_mib(env.sandbox.process.pid)
            out["sandbox"] = {k: env.sandbox.report()[k] for k in ("isolation", "host_uid", "sized_tmpfs", "seccomp")}
            env.reset()
            t = time.monotonic()
            env.step(Action(kind="hotkey", keys=["shift"]))
            typed.append(time.monotonic() - t)
        out.update(task=task, first_reset_s=resets[0],
                   reset_s=statistics.median(resets[1:] or resets), step_s=statistics.median(typed),
                   episode_s=statistics.median(solved), success=sum(rewards) / len(rewards),
                   total_s=time.monotonic() - t0)
    except Exception as e:  # reported, not raised: the other environments' figures still count
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        env.close()


def run(n_envs: int, screen: tuple[int, int], episodes: int) -> dict[str, Any]:
    outs: list[dict[str, Any]] = [{} for _ in range(n_envs)]
    threads = [threading.Thread(target=one_env, args=(TASKS[i % len(TASKS)], screen, episodes, outs[i]))
               for i in range(n_envs)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    ok = [o for o in outs if "error" not in o]
    summary = {"envs": n_envs, "wall_s": round(wall, 2), "errors": [o["error"] for o in outs if "error" in o]}
    for key in ("start_s", "reset_s", "step_s", "episode_s", "rss_mib", "success"):
        summary[key] = round(statistics.mean(o[key] for o in ok), 3) if ok else None
    summary["episodes_per_min"] = round(60 * episodes * len(ok) / wall, 1) if ok else None
    summary["per_env"] = outs
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--screen", default="1920x1080")
    parser.add_argument("--episodes", type=int, default=3, help="scripted episodes per environment")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--name", default="desktop_envs", help="results file name (without .json)")
    args = parser.parse_args(argv)
    screen = tuple(int(v) for v in args.screen.lower().split("x"))
    rows = [run(n, screen, args.episodes) for n in args.envs]
    result = {"benchmark": "desktop_envs", "screen": list(screen), "episodes_per_env": args.episodes,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "caller_uid": os.geteuid(),
              "python": sys.executable, "rows": rows,
              "command": "python benchmarks/bench_desktop.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = write_result(args.name, result, args.out)
    print(table(rows, ["envs", "start_s", "reset_s", "step_s", "episode_s", "rss_mib", "success",
                       "episodes_per_min", "wall_s"]))
    print(f"written {path}")
    return result


if __name__ == "__main__":
    sys.exit(0 if all(not r["errors"] for r in main()["rows"]) else 1)
