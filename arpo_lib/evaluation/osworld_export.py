"""Evaluation results in the layout of the ARPO authors' OSWorld fork, and readers of it.

The fork's evaluation runner (run_multienv_uitars.py, the one ARPO's README runs) writes one
directory per example and *trial*:

    <root>/<action_space>/<observation_type>/<model>/<trial_id>/<domain>/<example_id>/
        step_reset_<ts>.png            the screen after reset
        step_<n>_<ts>.png              the screen after action n (n = the model call, from 1)
        traj.jsonl                     a reset line, then one line per executed action
        result.txt                     the checker's score ("1.0"); absent = unfinished

    reset line:  {"step_num": 0, "instruction", "action_timestamp", "action": "reset", "reward": 0,
                  "done": false, "info": {}, "screenshot_file": "step_reset_<ts>.png"}
    action line: {"step_num", "prediction" (the model's response), "action_timestamp", "action"
                  (pyautogui code or WAIT/DONE/FAIL), "reward", "done", "info", "screenshot_file"}

`<example_id>` is the task file name, `<trial_id>` a number (its pass@n tool converts every entry
of the model directory with int()). Its readers, whose behaviour `trial_scores`, `unfinished` and
`pass_at_n` reproduce from that description: get_result (mean result.txt of one trial),
get_unfinished (examples of a meta list without result.txt), pass_at_n.py (a task is solved when
any trial scores > 0.5; --filter_fail zeroes an episode whose last action is FAIL after 15 calls).

`export_osworld_results` mirrors our evaluation (`<eval>/<family>/<task>/<sample>/`, trajectory
directories read through `arpo_lib.rollout.store`) into that layout: sample i is trial i. Lines
carry `prediction` and our `response` (the same text) plus our parse and action errors in `info`.
Episodes lost to infrastructure failures, and those left unfinished (a checker that raised under
the `osworld_uitars` protocol), get no result.txt and the fork's error line, as its runner writes
them: unfinished, not failures. A per-domain summary goes to `<root>/summary-<model>.json|md`,
outside the trees the fork's tools walk.

It lives in `evaluation/` (it was `envs/osworld/export.py`): it reads our trajectories through the
rollout store, which sits above the environments, and it is about results, not the environment.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo_lib.actions import Action, ActionParseError, to_pyautogui
from arpo_lib.envs import domain_of
from arpo_lib.rollout.store import read_trajectory, trajectory_dirs
from arpo_lib.run.records import atomic_write_text, safe_join, safe_name
from arpo_lib.types import EpisodeStatus


def osworld_domain(task: str) -> str:
    """The OSWorld domain of a task name (`chrome`, `gimp`, ...); other families: their prefix."""
    return domain_of(task)


def _example_id(task: str) -> str:
    return task.split("/", 1)[1] if "/" in task else task


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _codes(actions: list[dict[str, Any]], screen_size: tuple[int, int]) -> list[str]:
    codes = []
    for a in actions:
        try:
            codes.append(to_pyautogui(Action(**a), screen_size))
        except (ActionParseError, TypeError) as exc:
            codes.append(f"# not executable: {exc}")
    return codes


def export_osworld_results(eval_dir: str | Path, root: str | Path, model: str, *,
                           action_space: str = "pyautogui", observation_type: str = "screenshot") -> Path:
    """Mirror an evaluation directory into the fork's trial layout under `root`; returns the
    model directory (`<root>/<action_space>/<observation_type>/<model>`). Re-exporting replaces
    what a previous export of the same model wrote."""
    from PIL import Image

    eval_dir, root = Path(eval_dir), Path(root)
    trajs = trajectory_dirs(eval_dir)
    if not trajs:
        raise FileNotFoundError(f"{eval_dir} holds no complete trajectories (no <domain>/<task>/<sample>/ "
                                f"with a meta.json)")
    model_dir = safe_join(root, action_space, observation_type, model)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    stamp = time.strftime("%Y%m%d@%H%M%S")
    for src in trajs:
        stored = read_trajectory(src)
        traj = stored.trajectory
        dst = safe_join(model_dir, str(traj.sample), osworld_domain(traj.task), _example_id(traj.task))
        dst.mkdir(parents=True, exist_ok=True)
        lines = [{"step_num": 0, "instruction": traj.instruction, "action_timestamp": stamp,
                  "action": "reset", "reward": 0, "done": False, "info": {},
                  "screenshot_file": f"step_reset_{stamp}.png"}]
        if stored.screenshot(0):
            _link_or_copy(stored.screenshot(0), dst / f"step_reset_{stamp}.png")
        size = (1920, 1080)  # (without screenshots, coordinates are clipped to OSWorld's default screen)
        for rec in traj.steps:
            n = rec.step  # action n was taken on step_{n-1}.png; step_n.png is the screen after it
            seen = stored.screenshot(n - 1)
            if seen:
                with Image.open(seen) as im:
                    size = im.size
            name = f"step_{n}_{stamp}.png"
            if stored.screenshot(n):
                _link_or_copy(stored.screenshot(n), dst / name)
            # a malformed response stepped the environment with DONE (ARPO's rule)
            codes = _codes(rec.actions, size) if rec.actions else ["DONE"]
            for i, code in enumerate(codes):
                last = i == len(codes) - 1
                lines.append({"step_num": n, "prediction": rec.response, "action_timestamp": stamp,
                              "action": code, "reward": rec.reward if last else 0,
                              "done": (rec.terminated or rec.truncated) if last else False,
                              "info": {"parse_error": rec.parse_error, "truncated": rec.truncated,
                                       "action_error": rec.action_error},
                              "screenshot_file": name, "response": rec.response})
        if traj.status != EpisodeStatus.OK:  # the fork's runner writes this line and no result.txt
            what = "unfinished" if traj.status == EpisodeStatus.UNFINISHED else "infrastructure failure"
            lines.append({"Error": f"{what} in {dst.parent.name}/{dst.name}: {(traj.error or '')[:300]}"})
        (dst / "traj.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        if traj.status == EpisodeStatus.OK:
            (dst / "result.txt").write_text(f"{float(traj.task_score)}\n")
    write_summary(model_dir, root)
    return model_dir


# -- readers of the fork's layout (written from its documented behaviour) -------------------------

def _read_score(path: Path) -> float:
    """A result.txt as the fork's tools read it: "true"/"false", else a float (0 when unreadable)."""
    text = path.read_text().strip()
    if text.lower() in ("true", "false"):
        return float(text.lower() == "true")
    try:
        return float(text)
    except ValueError:
        return 0.0


def trials(model_dir: str | Path) -> list[int]:
    """The trial ids under a model directory (its numeric entries), sorted."""
    return sorted(int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit())


def trial_scores(model_dir: str | Path, trial_id: int | str) -> dict[tuple[str, str], float]:
    """(domain, example) -> score of every finished example of one trial (get_result's input)."""
    base = Path(model_dir) / str(trial_id)
    out = {}
    for result in sorted(base.glob("*/*/result.txt")) if base.is_dir() else []:
        if result.parent.parent.name == "onboard":
            continue
        out[(result.parent.parent.name, result.parent.name)] = _read_score(result)
    return out


def unfinished(model_dir: str | Path, trial_id: int | str, meta: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The examples of a meta list ({domain: [example ids]}) a trial has not finished (no
    result.txt): what get_unfinished would run again (it also empties their directories; this
    reader only reads)."""
    done = trial_scores(model_dir, trial_id)
    return {d: [e for e in ids if (d, e) not in done] for d, ids in meta.items()
            if any((d, e) not in done for e in ids)}


def _last_action_fails(example: Path) -> bool:
    lines = [json.loads(x) for x in (example / "traj.jsonl").read_text().splitlines() if x.strip()]
    return len(lines) >= 16 and lines[-1].get("action") == "FAIL"


def pass_at_n(model_dir: str | Path, meta: Mapping[str, Sequence[str]], trial_ids: Iterable[int] | None = None,
              filter_fail: bool = False) -> dict[str, Any]:
    """pass_at_n.py's numbers: a task is solved when any trial scores > 0.5. `acc` over tasks
    with at least one result, `acc_over_all` over the meta list, per domain, `overall_acc` over
    every (task, trial) result, per trial (denominator: the whole meta list) and their mean.
    A result needs both traj.jsonl and result.txt; `filter_fail` zeroes an episode that ran 15
    calls and ended with FAIL."""
    model_dir = Path(model_dir)
    ids = sorted(trial_ids) if trial_ids is not None else trials(model_dir)
    tasks = [(d, e) for d, examples in meta.items() for e in examples]
    results: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for t in ids:
        for d, e in tasks:
            example = model_dir / str(t) / d / e
            if (example / "traj.jsonl").is_file() and (example / "result.txt").is_file():
                score = _read_score(example / "result.txt")
                if filter_fail and _last_action_fails(example):
                    score = 0.0
                results[(d, e)][t] = score
    solved = {k for k, by_trial in results.items() if any(s > 0.5 for s in by_trial.values())}
    per_domain = {}
    for d, examples in meta.items():
        valid = [e for e in examples if (d, e) in results]
        per_domain[d] = {"solved": sum((d, e) in solved for e in valid), "valid": len(valid), "total": len(examples)}
    all_scores = [s for by_trial in results.values() for s in by_trial.values()]
    per_trial = {t: sum(results[k].get(t, 0.0) > 0.5 for k in results) / len(tasks) if tasks else 0.0 for t in ids}
    return {"tasks": len(tasks), "valid": len(results), "solved": len(solved),
            "acc": len(solved) / len(results) if results else 0.0,
            "acc_over_all": len(solved) / len(tasks) if tasks else 0.0,
            "overall_acc": sum(s > 0.5 for s in all_scores) / len(all_scores) if all_scores else 0.0,
            "per_domain": per_domain, "per_trial": per_trial,
            "mean_acc": sum(per_trial.values()) / len(per_trial) if per_trial else 0.0}


def write_summary(model_dir: Path, root: Path) -> dict[str, Any]:
    """summary-<model>.json/.md in `root`: per trial and domain success, and the unfinished examples."""
    by_trial = {}
    for t in trials(model_dir):
        scores = trial_scores(model_dir, t)
        domains: dict[str, list[float]] = defaultdict(list)
        for (d, _), s in scores.items():
            domains[d].append(s)
        listed = sorted(f"{p.parent.name}/{p.name}" for p in (model_dir / str(t)).glob("*/*") if p.is_dir())
        by_trial[t] = {"examples": len(scores), "success_rate": sum(scores.values()) / len(scores) if scores else 0.0,
                       "per_domain": {d: sum(v) / len(v) for d, v in sorted(domains.items())},
                       "unfinished": [x for x in listed if tuple(x.split("/")) not in scores]}
    summary = {"model": model_dir.name, "trials": by_trial}
    atomic_write_text(root / f"summary-{safe_name(model_dir.name)}.json", json.dumps(summary, indent=1))
    md = [f"# {safe_name(model_dir.name)}", "", "| trial | examples | success rate | unfinished |", "|---|---:|---:|---:|"]
    md += [f"| {t} | {r['examples']} | {r['success_rate']:.1%} | {len(r['unfinished'])} |" for t, r in by_trial.items()]
    atomic_write_text(root / f"summary-{safe_name(model_dir.name)}.md", "\n".join(md) + "\n")
    return summary
