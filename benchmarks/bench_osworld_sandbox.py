"""Speed and cost of OSWorld's own tasks on the desktop sandbox (provider "sandbox"): the first
reset (the sandbox starts, OSWorld's set-up runs), a later reset (OSWorld reverts a VM snapshot
here; the sandbox ends every process and restores a fresh home), one GUI action (a click, with
DesktopEnv's screenshot after it), the scripted solution's episode with OSWorld's evaluator, and
the memory of the sandbox's processes with the application open; 1 and N environments side by side
(threads, one sandbox each; environment i runs TASKS[i % len]).

Runs in the interpreter that has desktop_env (./workbench setup-osworld --light):
    PYTHONPATH=. <osworld-python> benchmarks/bench_osworld_sandbox.py                 # 1, 2 and 4 envs
    PYTHONPATH=. <osworld-python> benchmarks/bench_osworld_sandbox.py --envs 1 --episodes 1 --tasks-dir test_data/osworld_tasks

Tasks: one per application (Chrome, VLC, GIMP, Impress) from the fetched OSWorld task data
(`./workbench osworld-tasks fetch`); without it, the three real task files in test_data/osworld_tasks.
`--desktops gnome openbox` measures OSWorld's computer (GNOME, the default) beside the openbox
desktop in the same run (with `--tasks-dir test_data/osworld_sandbox`: two tasks whose solutions
need no coordinates, so both desktops run the same actions); `idle_cores` is the CPU the sandbox
uses with the application open and nothing happening (GNOME Shell's share).
Writes benchmarks/results/osworld_sandbox.json. Memory with the task's application open (after
OSWorld's set-up and one click), over the sandbox's processes: PSS (shared pages divided among the processes using them: what one more
environment costs) and RSS (shared pages counted once per process: too high).
"""
from __future__ import annotations

import argparse
import json
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
from benchmarks.bench_desktop import _tree_memory_mib, _tree_rss_mib  # noqa: E402
from benchmarks.common import table, write_result  # noqa: E402

TASKS = (("chrome", "2ae9ba84-3a0d-4d4c-8338-3a1478dc5fe3"), ("vlc", "f3977615-2b45-4ac5-8bba-80c17dbe2a37"),
         ("gimp", "d52d6308-ec58-42b7-a2c9-de80e4837b2b"),
         ("libreoffice_impress", "2cd43775-7085-45d8-89fa-9e35c0a915cf"))
"""One task per application, each with a scripted solution (sandbox_solutions.json)."""
SCREEN = (1920, 1080)


def _tree_pss_mib(root_pid: int) -> float:
    """Proportional set size of the process tree: shared pages divided among their users (what the
    tree costs the machine; RSS counts a shared library once per process)."""
    return _tree_memory_mib(root_pid, "smaps_rollup", "Pss:")


def task_files(tasks_dir: Path | None) -> list[Path]:
    if tasks_dir is not None:
        return sorted(p for p in tasks_dir.glob("*.json") if not p.name.startswith("_"))
    from arpo_lib.envs.osworld import tasks

    try:
        examples = tasks.examples_dir() / "examples"
        found = [examples / domain / f"{task_id}.json" for domain, task_id in TASKS]
        if all(p.is_file() for p in found):
            return found
    except (FileNotFoundError, ValueError):
        pass
    repo = Path(__file__).resolve().parents[1]
    return sorted((repo / "test_data" / "osworld_tasks").glob("*.json"))


def _tree_cpu_s(root_pid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of the tree under root_pid."""
    ticks, todo, seen = 0, [root_pid], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(after_name[11]) + int(after_name[12])
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


IDLE_S = 3.0
"""How long the desktop's idle CPU is measured (the application open, nothing happening)."""


def one_env(path: Path, episodes: int, pause_s: float, out: dict[str, Any], desktop: str = "gnome",
            prestart: bool = False) -> None:
    from arpo_lib.envs.osworld.env import OSWorldEnv
    from arpo_lib.envs.osworld.sandbox_check import solution_actions

    task = json.loads(path.read_text())
    actions = solution_actions(task, SCREEN, path.stem)
    env = OSWorldEnv(task, provider="sandbox", screen_size=SCREEN, max_steps=len(actions) + 2, pause_s=pause_s,
                     download_cache=None, desktop=desktop, prestart=prestart)
    try:
        resets, clicks, solved, scores, splits = [], [], [], [], []
        for _ in range(episodes):
            t = time.monotonic()
            splits.append(env.reset()[1].get("reset_timings") or {})
            resets.append(time.monotonic() - t)
            t = time.monotonic()
            env.step(Action(kind="click", point=(SCREEN[0] - 5, SCREEN[1] // 2)))
            clicks.append(time.monotonic() - t)
            box = env._desktop.sandbox  # the application open after OSWorld's set-up
            out["rss_mib"], out["pss_mib"] = _tree_rss_mib(box.process.pid), _tree_pss_mib(box.process.pid)
            cpu = _tree_cpu_s(box.process.pid)
            time.sleep(IDLE_S)
            out["idle_cores"] = (_tree_cpu_s(box.process.pid) - cpu) / IDLE_S
            t = time.monotonic()
            splits.append(env.reset()[1].get("reset_timings") or {})
            resets.append(time.monotonic() - t)
            t = time.monotonic()
            for action in actions:
                _, reward, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    break
            solved.append(time.monotonic() - t)
            scores.append(float(info.get("score", reward)))
        later = splits[1:] or splits  # the first reset starts the sandbox: no revert
        out.update(task=f"{path.parent.name}/{task['id'][:8]}", first_reset_s=resets[0],
                   reset_s=statistics.median(resets[1:] or resets),
                   reset_desktop_s=statistics.median(x.get("desktop_s", 0.0) for x in later),
                   reset_setup_s=statistics.median(x.get("setup_s", 0.0) + x.get("settle_s", 0.0) for x in later),
                   reset_session_s=statistics.median(x.get("session_s", 0.0) for x in later),
                   reset_profiles_s=statistics.median(x.get("profiles_s", 0.0) for x in later),
                   step_s=statistics.median(clicks),
                   episode_s=statistics.median(solved), solution_steps=len(actions), success=sum(scores) / len(scores))
    except Exception as e:  # reported, not raised: the other environments' figures still count
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        env.close()


def run(n_envs: int, files: list[Path], episodes: int, pause_s: float, desktop: str = "gnome",
        prestart: bool = False) -> dict[str, Any]:
    outs: list[dict[str, Any]] = [{} for _ in range(n_envs)]
    threads = [threading.Thread(target=one_env, args=(files[i % len(files)], episodes, pause_s, outs[i], desktop,
                                                      prestart))
               for i in range(n_envs)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    ok = [o for o in outs if "error" not in o]
    summary: dict[str, Any] = {"desktop": desktop, "prestart": prestart, "envs": n_envs, "wall_s": round(wall, 1),
                               "errors": [o["error"] for o in outs if "error" in o]}
    for key in ("first_reset_s", "reset_s", "reset_desktop_s", "reset_session_s", "reset_profiles_s", "reset_setup_s",
                "step_s", "episode_s", "rss_mib",
                "pss_mib", "idle_cores", "success"):
        summary[key] = round(statistics.mean(o[key] for o in ok), 2) if ok else None
    summary["pss_mib_max"] = round(max(o["pss_mib"] for o in ok), 1) if ok else None
    summary["episodes_per_min"] = round(60 * 2 * episodes * len(ok) / wall, 1) if ok else None  # + the click episodes
    summary["per_env"] = outs
    return summary


def per_core_and_gib(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per desktop (and prestart mode): at idle (the task's application open, nothing happening),
    desktops per core from one environment's idle CPU and per GiB from its PSS; while acting (every
    environment resetting and stepping at once), the most environments measured before one click's
    latency doubled against a single environment, per core, and their PSS per GiB. Only counts
    measured here; `doubled_within_measured` False means the latency never doubled up to the last."""
    out = []
    cores = os.cpu_count() or 1
    for key in sorted({(r["desktop"], r["prestart"]) for r in rows}):
        ok = sorted((r for r in rows if (r["desktop"], r["prestart"]) == key and r["step_s"]), key=lambda r: r["envs"])
        if not ok or ok[0]["envs"] != 1:
            continue
        within = [r for r in ok if r["step_s"] <= 2 * ok[0]["step_s"]]
        best = within[-1]
        out.append({"desktop": key[0], "prestart": key[1], "envs_measured": [r["envs"] for r in ok],
                    "idle_cores_per_env": ok[0]["idle_cores"],
                    "desktops_per_core_idle": round(1 / max(ok[0]["idle_cores"], 0.005), 1),
                    "desktops_per_gib_idle": round(1024 / ok[0]["pss_mib"], 1),
                    "envs_before_step_doubles": best["envs"], "step_s_1": ok[0]["step_s"], "step_s_at": best["step_s"],
                    "desktops_per_core_acting": round(best["envs"] / cores, 2),
                    "desktops_per_gib_acting": round(1024 / best["pss_mib"], 1),
                    "doubled_within_measured": len(within) < len(ok)})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--episodes", type=int, default=2, help="scripted episodes per environment")
    parser.add_argument("--pause-s", type=float, default=1.0, help="DesktopEnv's wait after an action")
    parser.add_argument("--tasks-dir", type=Path, default=None, help="task files (default: one per application)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--name", default="osworld_sandbox")
    parser.add_argument("--desktops", nargs="+", default=["gnome"], choices=("gnome", "openbox"),
                        help="the sandbox's desktops, measured one after the other in this run")
    parser.add_argument("--prestart", nargs="+", default=["off"], choices=("off", "on"),
                        help="reset the desktop in place (off) and/or hand over one made ready meanwhile (on)")
    args = parser.parse_args(argv)
    files = task_files(args.tasks_dir)
    rows = [run(n, files, args.episodes, args.pause_s, desktop, mode == "on")
            for n in args.envs for desktop in args.desktops for mode in args.prestart]
    density = per_core_and_gib(rows)
    result = {"benchmark": "osworld_sandbox", "screen": list(SCREEN), "episodes_per_env": args.episodes,
              "pause_s": args.pause_s, "tasks": [p.stem for p in files],
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.executable, "rows": rows,
              "density": density,
              "command": "python benchmarks/bench_osworld_sandbox.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = write_result(args.name, result, args.out)
    print(table(rows, ["desktop", "prestart", "envs", "first_reset_s", "reset_s", "reset_desktop_s", "reset_session_s",
                       "reset_profiles_s", "reset_setup_s",
                       "step_s", "episode_s", "pss_mib", "pss_mib_max", "rss_mib", "idle_cores", "success",
                       "episodes_per_min", "wall_s"]))
    if density:
        print(table(density, list(density[0])))
    print(f"written {path}")
    return result


if __name__ == "__main__":
    sys.exit(0 if all(not r["errors"] for r in main()["rows"]) else 1)
