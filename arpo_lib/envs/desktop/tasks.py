"""The desktop task suite: OSWorld-format task files (arpo_lib/envs/desktop/tasks/*.json), their
set-up steps, and the checkers that score the state they leave.

A task file has OSWorld's fields: `id`, `instruction`, `config` (set-up steps run before the first
screenshot), `related_apps`, `evaluator` ({"func", "result", "expected"}: a getter fetches the
result from the sandbox, the metric compares it with the expected rule). Two fields are ours,
prefixed `x_`: `x_solution`, the scripted solution as UI-TARS action texts (it scores 1; it is
also the warm start's demonstration), and an optional `x_note`.

Set-up steps: `launch` {command}, `execute` {command, shell}, `sleep` {seconds} and
`activate_window` {window_name, timeout} as OSWorld's; `create_files` {files: [{path, content,
mode}]} is ours (OSWorld uploads or downloads files instead).
Getters: `vm_file` {path, wait_s} (the file's bytes, None if absent) and `vm_path_info` {paths,
wait_s} (kind and mode of each). Metrics: `compare_text_lines` {lines}, `file_contains` {text} and
`check_paths` {dirs, files, absent, executable}; each returns 1.0 or 0.0.
"""
from __future__ import annotations

import functools
import json
import shlex
import time
from pathlib import Path
from typing import Any, Callable

from arpo_lib.envs.base import EnvError
from desktop_sandbox.sandbox import SandboxError

TASK_DIR = Path(__file__).with_name("tasks")


@functools.lru_cache(maxsize=None)
def desktop_tasks() -> tuple[str, ...]:
    """Ids of the suite's tasks, sorted."""
    return tuple(sorted(p.stem for p in TASK_DIR.glob("*.json")))


def load_task(task_id: str) -> dict[str, Any]:
    path = TASK_DIR / f"{task_id}.json"
    if not path.is_file():
        raise ValueError(f"no desktop task {task_id!r}: the suite has {', '.join(desktop_tasks())}")
    return json.loads(path.read_text())


def required_commands(task: dict[str, Any]) -> list[str]:
    """The programs a task's `launch` steps start (first word of each command)."""
    commands = []
    for step in task["config"]:
        if step["type"] == "launch":
            command = step["parameters"]["command"]
            first = shlex.split(command)[0] if isinstance(command, str) else command[0]
            commands.append(first)
    return list(dict.fromkeys(commands))


# ---- set-up ------------------------------------------------------------------------------

def run_setup(box: Any, config: list[dict[str, Any]]) -> None:
    """Run a task's set-up steps in order; EnvError names the step that failed."""
    for number, step in enumerate(config, 1):
        kind, params = step["type"], step.get("parameters", {})
        handler = SETUP_STEPS.get(kind)
        if handler is None:
            raise EnvError(f"set-up step {number}: unknown type {kind!r} (known: {', '.join(SETUP_STEPS)})")
        handler(box, **params)


def _create_files(box: Any, files: list[dict[str, Any]]) -> None:
    script = []
    for f in files:
        path = shlex.quote(f["path"])
        script.append(f"mkdir -p \"$(dirname {path})\" && printf %s {shlex.quote(f.get('content', ''))} > {path}")
        if f.get("mode"):
            script.append(f"chmod {shlex.quote(str(f['mode']))} {path}")
    done = box.execute(" && ".join(script), shell=True, timeout=30)
    if done["returncode"] != 0:
        raise EnvError(f"create_files failed: {done['error'][-500:]}")


def _execute(box: Any, command: list[str] | str, shell: bool = False) -> None:
    done = box.execute(command, shell=shell)
    if done["returncode"] != 0:
        raise EnvError(f"set-up command {command!r} failed ({done['returncode']}): {done['error'][-500:]}")


def _activate_window(box: Any, window_name: str, timeout: float = 30.0, strict: bool = False) -> None:
    """Wait until a visible window whose title contains `window_name` exists, then focus it."""
    deadline = time.monotonic() + timeout
    pattern = f"^{window_name}$" if strict else window_name
    while True:
        found = box.execute(["xdotool", "search", "--onlyvisible", "--name", pattern], timeout=10)
        ids = found["output"].split()
        if ids:
            box.execute(["xdotool", "windowactivate", "--sync", ids[-1]], timeout=10)
            return
        if time.monotonic() > deadline:
            names = box.execute("for w in $(xdotool search --name .); do xdotool getwindowname $w; done",
                                shell=True, timeout=10)["output"].split("\n")
            running = box.execute(["ps", "-eo", "comm="], timeout=10)["output"].split()
            raise EnvError(f"no window named like {window_name!r} appeared within {timeout:.0f} s "
                           f"(windows: {sorted(set(n for n in names if n))}; processes: {sorted(set(running))})"
                           + _launched_summary(box))
        time.sleep(0.2)


def _launched_summary(box: Any) -> str:
    """What the applications this episode launched did: '; launched: mousepad (exited 1: <its
    last output>)', or '' when none were launched."""
    try:
        apps = box.launched()
    except SandboxError:
        return ""
    parts = []
    for app in apps:
        command = app["command"] if isinstance(app["command"], str) else " ".join(app["command"])
        state = "running" if app["returncode"] is None else f"exited {app['returncode']}"
        output = " ".join(app["output"].split())[-300:]
        parts.append(f"{command} ({state}{': ' + output if output else ''})")
    return f"; launched: {'; '.join(parts)}" if parts else ""


SETUP_STEPS: dict[str, Callable[..., None]] = {
    "launch": lambda box, command, shell=False: box.launch(command, shell=shell),
    "execute": _execute,
    "sleep": lambda box, seconds: time.sleep(float(seconds)),
    "activate_window": _activate_window,
    "create_files": _create_files,
}


# ---- checking ----------------------------------------------------------------------------

def _vm_file(box: Any, path: str, wait_s: float = 0.0) -> bytes | None:
    """The file's bytes, or None if it does not exist (after waiting up to `wait_s` for it: some
    applications write their state a moment after the change)."""
    return _poll(lambda: box.read_file(path), lambda data: data is not None, wait_s)


def _vm_path_info(box: Any, paths: list[str], wait_s: float = 0.0) -> dict[str, dict[str, Any] | None]:
    """Kind ('file', 'dir', ...) and mode of each path, None where absent (waiting up to `wait_s`
    for every path to exist)."""
    # Read by the server itself (lstat): a `stat` run for it, as before, was a process of the agent's
    # user, into whose output pipe a program the agent left running wrote "directory|755".
    return _poll(lambda: box.path_info(paths), lambda info: None not in info.values(), wait_s)


def _poll(fetch: Callable[[], Any], ready: Callable[[Any], bool], wait_s: float) -> Any:
    """`fetch()` until `ready` says its result is there or `wait_s` have passed; the last result."""
    deadline = time.monotonic() + wait_s
    while True:
        result = fetch()
        if ready(result) or time.monotonic() >= deadline:
            return result
        time.sleep(0.25)


GETTERS: dict[str, Callable[..., Any]] = {"vm_file": _vm_file, "vm_path_info": _vm_path_info}


def compare_text_lines(result: bytes | None, lines: list[str]) -> float:
    """1 if the file exists and its lines (trailing spaces and trailing empty lines dropped) are `lines`."""
    if result is None:
        return 0.0
    got = [line.rstrip() for line in result.decode(errors="replace").splitlines()]
    while got and not got[-1]:
        got.pop()
    return float(got == list(lines))


def check_paths(result: dict[str, dict[str, Any] | None], dirs: list[str] = (), files: list[str] = (),
                absent: list[str] = (), executable: list[str] = ()) -> float:
    """1 if every path in `dirs` is a directory, in `files` a regular file, in `absent` missing, and
    in `executable` a file its owner may execute."""
    ok = all((result.get(p) or {}).get("kind") == "dir" for p in dirs)
    ok = ok and all((result.get(p) or {}).get("kind") == "file" for p in files)
    ok = ok and all(result.get(p) is None for p in absent)
    ok = ok and all((result.get(p) or {}).get("mode", 0) & 0o100 for p in executable)
    return float(ok)


def file_contains(result: bytes | None, text: str) -> float:
    """1 if the file exists and contains `text`."""
    return float(result is not None and text in result.decode(errors="replace"))


METRICS: dict[str, Callable[..., float]] = {"compare_text_lines": compare_text_lines, "check_paths": check_paths,
                                            "file_contains": file_contains}


def evaluate(box: Any, evaluator: dict[str, Any]) -> float:
    """The task's score for the sandbox's current state."""
    result_spec = dict(evaluator["result"])
    getter = GETTERS.get(result_spec.pop("type"))
    metric = METRICS.get(evaluator["func"])
    if getter is None or metric is None:
        raise EnvError(f"unknown evaluator {evaluator['func']!r} / getter {evaluator['result']['type']!r}")
    rules = evaluator.get("expected", {}).get("rules", {})
    return metric(getter(box, **result_spec), **rules)
