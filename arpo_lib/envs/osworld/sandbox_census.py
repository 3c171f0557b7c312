"""Every OSWorld task file through set-up and evaluation on the desktop sandbox, with a no-op agent:
which tasks run here, and why the others do not.

    python -m arpo_lib.envs.osworld.sandbox_census EXAMPLES_DIR [--out results.jsonl] [--markdown table.md]
        [--domains os,vlc] [--screen 1920x1080]

EXAMPLES_DIR is OSWorld's `evaluation_examples/examples` (`./workbench osworld-tasks fetch` caches it).
Runs in the interpreter that has desktop_env. Each task lands in exactly one column:

    scores      set up in the sandbox and scored by OSWorld's own evaluator: a no-op scores 0 (a
                no-op scoring 1 is a failure: the initial state differs from the VM's), and an
                infeasible task scores 1 when the agent answers FAIL
    download    its set-up or checker downloads files (named): runnable once they are in the shared
                download cache (`osworld-tasks prefetch` on a machine with internet)
    internet    it needs the live internet or an account (open web pages, Google Drive, a login)
    vscode      it needs VS Code and this machine has none (code-server, installed by
                setup-desktop --osworld where node 20 is: docs/vscode.md); with it, such tasks are run
    fails       none of the above, and it still does not set up or score here (the reason)

And a second judgement, `solvable` (the "solvable here" column): for a feasible task whose file
needs no network (columns scores, vscode, fails), "yes" when a scripted solution of GUI actions
scores 1 with OSWorld's evaluator (sandbox_solutions.json; `sandbox_check --solved` proves it),
else the named reason it cannot be solved here (sandbox_unsolvable.json), else "not tried";
"FAIL" for an infeasible task whose FAIL scores 1; "network" for the download and internet columns.
The set-up's failures (a command that failed, a window not there: server.Desktop.setup_report)
are recorded per task run (`setup_failures`), and so is a set-up step that passed only because
what it installs was on the host already (`preinstalled`: `sudo apt-get install sysstat` succeeds
in a sandbox that can install nothing, because Debian's sysstat is there; on the VM the step
installs it).

The first three columns are decided by reading the task file (the rules are `static_column`); a
task not in them is run. Counting rules: a task is `download` when any set-up step or getter of it
fetches a URL (set-up `download`, `cloud_file`, `cache_file` with a URL) and nothing needs the live
internet; `internet` wins over `download`.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from desktop_sandbox import a11y

COLUMNS = ("scores", "download", "internet", "vscode", "fails")
INTERNET_STEPS = {"chrome_open_tabs", "chrome_close_tabs", "login", "googledrive", "update_browse_history"}
INTERNET_GETTERS = {"googledrive_file", "page_info", "info_from_website", "pdf_from_url", "number_of_search_results",
                    "gotoRecreationPage_and_get_html_content"}
A11Y_GETTERS = {"accessibility_tree", "active_url_from_accessTree", "active_tab_info", "active_tab_html_parse",
                "active_tab_url_parse", "url_dashPart"}
"""Getters that read the AT-SPI tree (the chrome ones find the address bar in it): run where the
sandbox serves /accessibility (desktop_sandbox/a11y.py), `fails` elsewhere."""
A11Y_NOT_SERVED = "needs /accessibility (the AT-SPI tree), which this machine cannot serve: {}"
NEVER_MATCHES = ("its metric check_left_panel looks for cp:parentcoord in the uri:deskat:... namespace, which OSWorld's "
                 "own server never writes (no parentcoord; its namespaces are https://accessibility.ubuntu.example.org/ns/..., "
                 "as the sandbox's): it cannot score 1 on OSWorld's VM either")
"""Why a task whose metric can match no tree OSWorld's server writes is not run (see `_never_matches`)."""
DOWNLOAD_GETTERS = {"cloud_file"}
VSCODE_WORDS = ("code ", "\"code\"", "'code'", "vscode", "code.desktop")
VSCODE_GETTERS = {"vscode_config"}
NOT_HERE = {"timedatectl": "needs systemd (timedatectl): the sandbox runs no init system"}
if not Path("/usr/bin/pulseaudio").exists():
    NOT_HERE["pactl"] = "needs a PulseAudio server: install Debian's pulseaudio (./workbench setup does)"
"""What a task file may name that the sandbox lacks, with the reason (column `fails`, not run)."""


def _walk(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)
    else:
        yield value


def _getters(task: dict[str, Any]) -> list[dict[str, Any]]:
    evaluator = task.get("evaluator", {})
    out = []
    for key in ("result", "expected"):
        value = evaluator.get(key, [])
        out += [g for g in (value if isinstance(value, list) else [value]) if isinstance(g, dict)]
    return out


def _steps(task: dict[str, Any]) -> list[dict[str, Any]]:
    return list(task.get("config", [])) + list(task.get("evaluator", {}).get("postconfig", []))


def _never_matches(task: dict[str, Any]) -> bool:
    """Whether the task's metric matches no tree OSWorld's server writes: check_left_panel (in
    both desktop_env builds) reads cp:parentcoord, which no server writes, in the uri:deskat:...
    namespace, which its server does not use. (check_accessibility_tree's rules with `attr|`
    selectors match in PyPI's desktop-env 1.0.2, whose metric maps the prefixes to the server's
    namespaces, and not in the ARPO fork's, which maps them to uri:deskat:...: left to be run.)"""
    funcs = task.get("evaluator", {}).get("func", [])
    return "check_left_panel" in (funcs if isinstance(funcs, list) else [funcs])


VSCODE_MISSING = "needs VS Code, which is not installed here (setup-desktop --osworld installs code-server: docs/vscode.md)"


def static_column(task: dict[str, Any], a11y_missing: str | None = None,
                  vscode_missing: str | None = VSCODE_MISSING) -> tuple[str, str] | None:
    """(column, reason) when reading the task file decides it; None when it must be run.
    `a11y_missing`: why this machine cannot serve the accessibility tree (None: it can);
    `vscode_missing`: why the sandbox has no VS Code (None: it has, and such tasks are run)."""
    steps, getters = _steps(task), _getters(task)
    internet = sorted({s["type"] for s in steps if s["type"] in INTERNET_STEPS} |
                      {g["type"] for g in getters if g.get("type") in INTERNET_GETTERS})
    if internet:
        return "internet", ", ".join(internet)
    urls = [s for s in _walk({"config": steps, "getters": getters}) if isinstance(s, str)
            and s.startswith(("http://", "https://"))]
    downloads = [u for u in urls if any(s["type"] == "download" for s in steps) or
                 any(g.get("type") in DOWNLOAD_GETTERS | {"cache_file"} for g in getters)]
    if downloads:
        hosts = Counter(urllib.parse.urlparse(u).netloc for u in downloads)
        return "download", f"{len(downloads)} file(s) from " + ", ".join(f"{h} ({n})" for h, n in hosts.most_common())
    if urls:
        return "internet", f"opens {urllib.parse.urlparse(urls[0]).netloc}"
    text = json.dumps(steps) + json.dumps(getters)
    pieces = sorted({w.strip("\"' ") for w in VSCODE_WORDS if w in text} |
                    {g["type"] for g in getters if g.get("type") in VSCODE_GETTERS})
    if pieces and vscode_missing:
        return "vscode", ", ".join(pieces)
    reads_tree = any(g.get("type") in A11Y_GETTERS for g in getters)
    missing = sorted({reason for word, reason in NOT_HERE.items() if word in text} |
                     ({A11Y_NOT_SERVED.format(a11y_missing)} if reads_tree and a11y_missing else set()) |
                     ({NEVER_MATCHES} if reads_tree and _never_matches(task) else set()))
    if missing:
        return "fails", "; ".join(missing)
    return None


APT_INSTALL = re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\s+((?:[^\s&;|]+\s*)+)")


def preinstalled(task: dict[str, Any], installed: Callable[[str], bool]) -> list[str]:
    """The task's set-up commands that install Debian packages (`apt install`, `apt-get install`)
    all of which `installed(package)` says are there already: in the sandbox such a step succeeds
    without installing anything, so the task's starting state is the host's doing, not its set-up's."""
    out = []
    for step in task.get("config", []):
        if step.get("type") not in ("execute", "command", "execute_with_verification"):
            continue
        command = (step.get("parameters") or {}).get("command")
        text = command if isinstance(command, str) else " ".join(str(c) for c in command or [])
        for match in APT_INSTALL.finditer(text):
            packages = [w for w in match.group(1).split() if not w.startswith("-")]
            if packages and all(installed(p) for p in packages):
                out.append(f"`apt install {' '.join(packages)}` passed only because the host has "
                           f"{', '.join(packages)} installed (the sandbox installs nothing)")
    return out


def dpkg_installed(package: str) -> bool:
    """Whether Debian's package database (the host's, which the sandbox reads) has `package` installed."""
    done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return done.returncode == 0 and "install ok installed" in done.stdout


def run_task(env: Any, task: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """Set the task up in the sandbox, end the episode at once (DONE; FAIL too for an infeasible
    task) and score it with OSWorld's evaluator."""
    facts: dict[str, Any] = {}
    started = time.monotonic()
    try:
        env.reset(task_config=task)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return "fails", f"set-up: {type(e).__name__}: {str(e)[:300]}", facts
    facts["reset_s"] = round(time.monotonic() - started, 1)
    facts["setup_failures"] = list(getattr(env, "setup_failures", None) or [])
    if passed := preinstalled(task, dpkg_installed):
        facts["preinstalled"] = passed
    failed = [a for a in env.sandbox.launched() if a["returncode"] not in (None, 0)]
    answers = ["DONE", "FAIL"] if task.get("evaluator", {}).get("func") == "infeasible" else ["DONE"]
    scores = []
    for answer in answers:
        if answer != answers[0]:
            env.reset(task_config=task)
        env.step(answer, pause=0)
        try:
            scores.append(float(env.evaluate()))
        except Exception as e:  # noqa: BLE001
            reason = f"checker: {type(e).__name__}: {str(e)[:300]}"
            if failed:
                reason += "; " + _launch_failures(failed)
            return "fails", reason, facts
    facts["scores"] = scores
    if failed and scores[0] == 0.0 and len(answers) == 1:
        # it scored, but an application it needs did not start: say so (a no-op 0 proves little then)
        return "fails", _launch_failures(failed), facts
    if len(answers) == 1 and scores[0] > 0.0:
        return "fails", (f"a no-op scores {scores[0]:g}: the sandbox's initial state already satisfies the checker "
                         "(it differs from OSWorld's VM image here)"), facts
    if len(answers) == 2 and scores != [0.0, 1.0]:
        return "fails", f"infeasible task scored {scores} for DONE, FAIL", facts
    return "scores", f"no-op {scores[0]:g}" + (", FAIL 1" if len(answers) == 2 else ""), facts


def _launch_failures(apps: list[dict[str, Any]]) -> str:
    parts = []
    for app in apps[:3]:
        command = app["command"] if isinstance(app["command"], str) else " ".join(app["command"])
        output = " ".join(app["output"].split())[-160:]
        parts.append(f"`{command[:60]}` exited {app['returncode']}" + (f" ({output})" if output else ""))
    return "launched: " + "; ".join(parts)


def solvable(row: dict[str, Any], task: dict[str, Any]) -> str:
    """The "solvable here" judgement of one census row (see the module's docstring)."""
    from arpo_lib.envs.osworld.tasks import known_solutions, known_unsolvable

    if row["task"] in known_solutions() and task.get("evaluator", {}).get("func") != "infeasible":
        return "yes"  # a file that names the network may still be solvable offline (its checker reads local state)
    if row["column"] in ("download", "internet"):
        return "network"
    if task.get("evaluator", {}).get("func") == "infeasible":
        if row["column"] == "scores":
            return "FAIL"
        return "no: " + (row["reason"] if row["column"] == "fails" else VSCODE_MISSING)
    if row["task"] in known_solutions():
        return "yes"
    if row["task"] in known_unsolvable():
        return "no: " + known_unsolvable()[row["task"]]
    if row["column"] in ("fails", "vscode"):
        return "no: " + (row["reason"] if row["column"] == "fails" else VSCODE_MISSING)
    return "not tried"


def markdown(rows: list[dict[str, Any]]) -> str:
    domains = sorted({r["domain"] for r in rows})
    lines = ["| domain | tasks | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    totals = Counter()
    for domain in domains:
        counts = Counter(r["column"] for r in rows if r["domain"] == domain)
        totals.update(counts)
        n = sum(counts.values())
        lines.append(f"| {domain} | {n} | " + " | ".join(str(counts.get(c, 0)) for c in COLUMNS) + " |")
    lines.append(f"| **total** | **{sum(totals.values())}** | " + " | ".join(f"**{totals.get(c, 0)}**" for c in COLUMNS) + " |")
    solved = [r for r in rows if r.get("solvable") == "yes"]
    lines += ["", f"**Solvable here: {len(solved)} feasible task files over {len({r['domain'] for r in solved})} "
                  f"domains** ({', '.join(f'{d} {n}' for d, n in sorted(Counter(r['domain'] for r in solved).items()))}); "
                  f"infeasible ones whose FAIL scores 1: {sum(r.get('solvable') == 'FAIL' for r in rows)}.", ""]
    lines += ["| task | domain | column | reason | solvable here | set-up failures |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (COLUMNS.index(r["column"]), r["domain"], r["task"])):
        if r["column"] in ("scores", "fails", "vscode"):
            failures = "; ".join([*(r.get("setup_failures") or []), *(r.get("preinstalled") or [])])
            lines.append(f"| `{r['task'][:8]}` | {r['domain']} | {r['column']} | {r['reason'].replace('|', '/')} | "
                         f"{r.get('solvable', '').replace('|', '/')} | {failures.replace('|', '/')[:300]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="OSWorld's evaluation_examples/examples")
    parser.add_argument("--out", type=Path, default=Path("osworld_sandbox_census.jsonl"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--domains", default="", help="comma-separated domains (default: all)")
    parser.add_argument("--screen", default="1920x1080")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    screen = tuple(int(v) for v in args.screen.lower().split("x"))
    wanted = {d for d in args.domains.split(",") if d}
    files = sorted(p for p in args.examples.glob("*/*.json") if not wanted or p.parent.name in wanted)
    done = {}
    if args.out.exists():  # resumable: tasks already in the file are kept
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done[row["task"]] = row
    env = None
    a11y_missing = a11y.unavailable()
    from desktop_sandbox.confinement import vscode_home
    vscode_missing = None if vscode_home() else VSCODE_MISSING
    try:
        with open(args.out, "a") as out:
            for number, path in enumerate(files, 1):
                task_id = path.stem
                if task_id in done:
                    continue
                task = json.loads(path.read_text())
                decided = static_column(task, a11y_missing, vscode_missing)
                facts: dict[str, Any] = {}
                if decided is None:
                    if env is None:
                        from desktop_sandbox.osworld import SandboxDesktopEnv

                        env = SandboxDesktopEnv(action_space="pyautogui", screen_size=screen,
                                                cache_dir=str(args.out.parent / "census-cache"))
                    column, reason, facts = run_task(env, task)
                else:
                    column, reason = decided
                row = {"task": task_id, "domain": path.parent.name, "column": column, "reason": reason, **facts}
                row["solvable"] = solvable(row, task)
                done[task_id] = row
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"[{number}/{len(files)}] {path.parent.name}/{task_id[:8]}: {column} ({reason[:100]})",
                      file=sys.stderr, flush=True)
    finally:
        if env is not None:
            env.close()
    rows = [done[p.stem] for p in files if p.stem in done]
    for path in files:  # the judgement follows the solutions as they are now, also for rows kept from a file
        if path.stem in done:
            done[path.stem]["solvable"] = solvable(done[path.stem], json.loads(path.read_text()))
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    print(json.dumps(Counter(r["column"] for r in rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
