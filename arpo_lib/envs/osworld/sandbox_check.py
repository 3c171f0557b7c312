"""Run OSWorld-format task files on the desktop sandbox with OSWorld's own DesktopEnv: each task
once with a no-op agent (it answers finished() at once) and once with its scripted solution
(`x_solution`: UI-TARS action texts, sent as real GUI actions; for OSWorld's own task files, ours
in sandbox_solutions.json, by the file's name), scored by OSWorld's evaluator.

    python -m arpo_lib.envs.osworld.sandbox_check [--screen 1920x1080] TASK.json [...]
    python -m arpo_lib.envs.osworld.sandbox_check --solved <evaluation_examples/examples>
        (every OSWorld task file we have a scripted solution for)
    python -m arpo_lib.envs.osworld.sandbox_check --shots /tmp/shots TASK.json
        (the screen after every action saved, to write a solution's coordinates from)
    python -m arpo_lib.envs.osworld.sandbox_check --noop TASK.json [...]
        (the no-op alone: for task files without a solution)

Runs in the interpreter that has desktop_env (`./workbench setup-osworld`); prints one JSON line
per task: {"task", "noop", "solved", "reset_s", "settle_s", "step_s", "setup_failures", "errors"};
exit status 1 unless every no-op scored 0 and every solution 1. A task file desktop_env refuses
(a step it does not know) or an episode that fails is reported on its line ("error") and the run
goes on to the next file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from arpo_lib.actions import Action, parse_response
from arpo_lib.envs.osworld.tasks import known_solutions, load_task




def scripted_solution(task: dict[str, Any], task_id: str | None = None) -> list[str] | None:
    """The task's `x_solution`, else ours for an OSWorld task file; None when there is none."""
    if "x_solution" in task:
        return list(task["x_solution"])
    known = known_solutions()
    entry = known.get(task_id or task.get("id", "")) or known.get(task.get("id", ""))
    return list(entry["solution"]) if entry else None


def osworld_solution_texts(task_id: str) -> list[str] | None:
    """The scripted solution of `osworld/<task_id>` (the cached task file's `x_solution`, else ours)."""
    try:
        task = load_task(task_id)
    except (KeyError, ValueError, FileNotFoundError):
        task = {"id": task_id}
    return scripted_solution(task, task_id)


def solution_actions(task: dict[str, Any], screen: tuple[int, int], task_id: str | None = None) -> list[Action]:
    texts = scripted_solution(task, task_id)
    if texts is None:
        raise ValueError(f"no scripted solution for task {task_id or task.get('id')!r}")
    actions: list[Action] = []
    for text in [*texts, "finished(content='')"]:  # after call_user() (FAIL) the episode is over already
        actions += parse_response(f"Thought: scripted\nAction: {text}", screen, "qwen25vl").actions
    return actions


def run_episode(task: dict[str, Any], actions: list[Action], screen: tuple[int, int], shots: Path | None = None,
                **options: Any) -> dict[str, Any]:
    """One episode; with `shots`, the screen after the reset and after every action is saved there
    as NN.png (what you look at to write or mend a solution's coordinates)."""
    from arpo_lib.envs.osworld.env import OSWorldEnv

    env = OSWorldEnv(task, provider="sandbox", screen_size=screen, max_steps=max(len(actions), 1), **options)
    try:
        started = time.monotonic()
        observation, reset_info = env.reset()
        reset_s = time.monotonic() - started
        settle_s = getattr(env._desktop, "settle_s", None)
        if shots is not None:
            shots.mkdir(parents=True, exist_ok=True)
            observation.screenshot.save(shots / "00.png")
        score, errors, step_times = 0.0, [], []
        for number, action in enumerate(actions, 1):
            started = time.monotonic()
            observation, reward, terminated, truncated, info = env.step(action)
            step_times.append(time.monotonic() - started)
            if shots is not None:
                observation.screenshot.save(shots / f"{number:02d}.png")
            if info.get("action_error"):
                errors.append(info["action_error"])
            if info.get("checker_error"):
                errors.append(info["checker_error"])
            if terminated or truncated:
                score = float(info.get("score", reward))
                break
        return {"score": score, "reset_s": round(reset_s, 2), "settle_s": None if settle_s is None else round(settle_s, 2),
                "step_s": round(sum(step_times) / max(len(step_times), 1), 2),
                "setup_failures": list(reset_info.get("setup_failures") or []), "errors": errors}
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", type=Path)
    parser.add_argument("--solved", type=Path, default=None, metavar="EXAMPLES_DIR",
                        help="also every OSWorld task with a solution in sandbox_solutions.json, from OSWorld's "
                             "evaluation_examples/examples")
    parser.add_argument("--screen", default="1920x1080")
    parser.add_argument("--pause-s", type=float, default=0.5)
    parser.add_argument("--shots", type=Path, default=None, metavar="DIR",
                        help="save the screen after the reset and every solution action as DIR/<task>/NN.png")
    parser.add_argument("--noop", action="store_true", help="run the no-op episode only (no solution needed)")
    parser.add_argument("--desktop", default="gnome", choices=("gnome", "openbox"), help="the sandbox's desktop")
    args = parser.parse_args(argv)
    screen = tuple(int(v) for v in args.screen.lower().split("x"))
    tasks = list(args.tasks)
    if args.solved is not None:
        tasks += [args.solved / entry["domain"] / f"{task_id}.json" for task_id, entry in known_solutions().items()]
    if not tasks:
        parser.error("no task files (give some, or --solved EXAMPLES_DIR)")
    ok = True
    for path in tasks:
        line = check_task(path, screen, args.noop, args.shots, pause_s=args.pause_s, desktop=args.desktop)
        ok &= line.get("error") is None and line["noop"] == 0.0 and (args.noop or line["solved"] == 1.0)
        print(json.dumps(line), flush=True)
    return 0 if ok else 1


def check_task(path: Path, screen: tuple[int, int], noop_only: bool = False, shots: Path | None = None,
               **options: Any) -> dict[str, Any]:
    """One task file's line: its no-op episode and (unless `noop_only`) its scripted solution's.
    A file that cannot be run (desktop_env refuses it, no solution, an episode that fails) is
    reported in "error", never raised: a check of many files goes on."""
    from arpo_lib.envs.base import EnvError
    from arpo_lib.envs.osworld.env import OSWorldSetupError

    line: dict[str, Any] = {"task": path.stem, "noop": None, "solved": None}
    options = {"download_cache": None, **options}
    try:
        task = json.loads(path.read_text())
        line["task"] = task.get("id", path.stem)
        noop = run_episode(task, [Action("finished")], screen, **options)
        line.update(noop=noop["score"], reset_s=noop["reset_s"], settle_s=noop["settle_s"],
                    setup_failures=noop["setup_failures"], errors=noop["errors"])
        if not noop_only:
            solved = run_episode(task, solution_actions(task, screen, path.stem), screen,
                                 shots / path.stem if shots is not None else None, **options)
            line.update(solved=solved["score"], reset_s=solved["reset_s"], settle_s=solved["settle_s"],
                        step_s=solved["step_s"], errors=noop["errors"] + solved["errors"])
        line["error"] = None
    except (OSWorldSetupError, EnvError, ValueError, OSError) as e:
        line["error"] = f"{type(e).__name__}: {e}"[:1000]
    return line


if __name__ == "__main__":
    sys.exit(main())
