"""Evaluation results in OSWorld's own result layout, so its tooling (show_result.py and the
resume logic of its run scripts) reads them unchanged.

OSWorld writes one directory per task and run:

    <root>/<action_space>/<observation_type>/<model>/<domain>/<example_id>/
        step_<n>_<timestamp>.png    the screen after action n (n from 1)
        traj.jsonl                  {step_num, action_timestamp, action, response, reward, done, info, screenshot_file}
        result.txt                  the checker's score, e.g. "1.0"

and its tools average `result.txt` over every example directory, per domain and overall; a
directory without `result.txt` counts as unfinished (its run script re-runs it).

Our evaluation keeps its own layout (`<eval>/<family>/<task>/<sample>/`, with tokens and meta);
`export_osworld_results` mirrors it into OSWorld's, hard-linking screenshots where it can. OSWorld
has one run per task, so sample i of k goes under the model name `<model>-sample<i>` when k > 1.
Episodes that failed for infrastructure reasons get no `result.txt`, as in OSWorld: they are
unfinished, not failures. A per-domain summary (summary.json, summary.md) is written beside the
domain directories, where OSWorld's tools (which only descend into directories) ignore it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from arpo_lib.actions import Action, ActionParseError, to_pyautogui
from arpo_lib.envs import domain_of
from arpo_lib.run.records import atomic_write_text, safe_join, safe_name


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


def _pyautogui_codes(actions: list[dict[str, Any]], screen_size: tuple[int, int]) -> list[str]:
    codes = []
    for a in actions:
        try:
            codes.append(to_pyautogui(Action(**a), screen_size))
        except (ActionParseError, TypeError) as exc:
            codes.append(f"# not executable: {exc}")
    return codes


def _trajectory_dirs(eval_dir: Path) -> list[Path]:
    """Complete trajectory directories (meta.json marks them complete) under our eval layout."""
    return sorted(p.parent for p in eval_dir.glob("*/*/*/meta.json"))


def export_osworld_results(eval_dir: str | Path, root: str | Path, model: str, *,
                           action_space: str = "pyautogui", observation_type: str = "screenshot") -> Path:
    """Mirror an evaluation directory into OSWorld's layout under `root`; returns the model's
    directory (for k = 1) or `root/<action_space>/<observation_type>` (for k > 1).

    Re-exporting replaces what a previous export wrote for the same model names.
    """
    from PIL import Image

    eval_dir, root = Path(eval_dir), Path(root)
    trajs = _trajectory_dirs(eval_dir)
    if not trajs:
        raise FileNotFoundError(f"{eval_dir} holds no complete trajectories (no */*/*/meta.json)")
    metas = [(d, json.loads((d / "meta.json").read_text())) for d in trajs]
    samples = {m["sample"] for _, m in metas}
    base = safe_join(root, action_space, observation_type)
    model_dirs: dict[int, Path] = {s: safe_join(base, model if len(samples) == 1 else f"{model}-sample{s}")
                                   for s in samples}
    for d in model_dirs.values():
        if d.exists():
            shutil.rmtree(d)
    stamp = time.strftime("%Y%m%d@%H%M%S")
    size = (1920, 1080)
    for src, meta in metas:
        dst = safe_join(model_dirs[meta["sample"]], osworld_domain(meta["task"]), _example_id(meta["task"]))
        dst.mkdir(parents=True, exist_ok=True)
        lines = []
        for line in (src / "traj.jsonl").read_text().splitlines():
            rec = json.loads(line)
            n = rec["step_num"]  # action n was taken on step_{n-1}.png; step_n.png is the screen after it
            seen = src / f"step_{n - 1}.png"
            if seen.is_file():
                with Image.open(seen) as im:
                    size = im.size
            # (without screenshots, coordinates are clipped to OSWorld's default screen)
            shot = src / f"step_{n}.png"
            name: str | None = f"step_{n}_{stamp}.png"
            if shot.is_file():
                _link_or_copy(shot, dst / name)
            else:  # no screen after the last action (a format failure ended the episode)
                name = None
            lines.append(json.dumps({
                "step_num": n, "action_timestamp": stamp, "action": "\n".join(_pyautogui_codes(rec["action"], size)),
                "response": rec["response"], "reward": rec["reward"], "done": rec["done"],
                "info": {"parse_error": rec["parse_error"], "truncated": rec.get("truncated", False)},
                "screenshot_file": name}))
        (dst / "traj.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
        first = src / "step_0.png"
        if first.is_file():
            _link_or_copy(first, dst / "step_0.png")
        if meta["status"] == "ok":
            (dst / "result.txt").write_text(f"{float(meta['task_score'])}\n")
    for d in model_dirs.values():
        write_domain_summary(d)
    return next(iter(model_dirs.values())) if len(model_dirs) == 1 else base


def read_osworld_results(model_dir: str | Path) -> dict[str, list[float]]:
    """domain -> scores, read the way OSWorld's show_result.py reads them: every
    `<domain>/<example>/result.txt` under the model directory, unparsable files as 0."""
    out: dict[str, list[float]] = defaultdict(list)
    model_dir = Path(model_dir)
    for domain in sorted(p for p in model_dir.iterdir() if p.is_dir()):
        for example in sorted(p for p in domain.iterdir() if p.is_dir()):
            result = example / "result.txt"
            if result.is_file():
                try:
                    out[domain.name].append(float(result.read_text()))
                except ValueError:
                    out[domain.name].append(0.0)
    return dict(out)


def write_domain_summary(model_dir: str | Path) -> dict[str, Any]:
    """summary.json and summary.md beside the domain directories: success per domain and overall,
    plus the unfinished examples (no result.txt: infrastructure failures to re-run)."""
    model_dir = Path(model_dir)
    scores = read_osworld_results(model_dir)
    unfinished = sorted(f"{p.parent.name}/{p.name}" for p in model_dir.glob("*/*")
                        if p.is_dir() and not (p / "result.txt").is_file())
    rows = {d: {"examples": len(s), "success_rate": sum(s) / len(s) if s else 0.0} for d, s in scores.items()}
    all_scores = [x for s in scores.values() for x in s]
    summary = {"model": model_dir.name, "examples": len(all_scores),
               "success_rate": sum(all_scores) / len(all_scores) if all_scores else 0.0,
               "per_domain": rows, "unfinished": unfinished}
    atomic_write_text(model_dir / "summary.json", json.dumps(summary, indent=1))
    md = [f"# {safe_name(model_dir.name)}: {summary['success_rate']:.1%} over {len(all_scores)} examples", "",
          "| domain | examples | success rate |", "|---|---:|---:|"]
    md += [f"| {d} | {r['examples']} | {r['success_rate']:.1%} |" for d, r in rows.items()]
    if unfinished:
        md += ["", f"Unfinished (infrastructure failures, no result.txt): {len(unfinished)}"]
    atomic_write_text(model_dir / "summary.md", "\n".join(md) + "\n")
    return summary
