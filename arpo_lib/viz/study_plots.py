"""Figures of a study (`experiments.run_comparison`, task selection): the selected tasks, the arms
side by side with their intervals and per-seed gains, and each instance's curves. Inputs are the
study's report.json and a selection's results."""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo_lib.run import layout
from arpo_lib.run.registry import COMPARISON_ARMS
from arpo_lib.viz.figures import ReportFigure, no_data


def plot_selection(selection: str | Path | dict[str, Any]) -> Figure:
    """Successes out of k per task (kept tasks in colour, dropped ones grey) and the kept share
    per domain. `selection`: a selection directory, its selection.json, or that dict."""
    if not isinstance(selection, dict):
        path = Path(selection)
        path = path / layout.SELECTION_RESULT if path.is_dir() else path
        selection = json.loads(path.read_text())
    tasks, k = selection["tasks"], selection["k"]
    domains = selection.get("per_domain", {})
    height = max(2.0, 0.3 * len(tasks) + 1.0)
    fig = ReportFigure(figsize=(11, height + 0.6), layout="constrained")
    ax_t, ax_d = fig.subplots(1, 2, width_ratios=[2, 1])
    names = [t["task"] for t in tasks]
    ax_t.barh(range(len(tasks)), [t["successes"] for t in tasks],
              color=["C2" if t["kept"] else "0.7" for t in tasks])
    ax_t.set_yticks(range(len(tasks)), names, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlim(0, k)
    ax_t.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.axvline(selection["min_successes"] - 0.5, color="C3", lw=1, ls="--")
    ax_t.set_xlabel(f"successes in k={k} rollouts (kept: >= {selection['min_successes']})")
    if domains:
        ax_d.barh(range(len(domains)), [d["kept_share"] for d in domains.values()], color="C0")
        ax_d.set_yticks(range(len(domains)), list(domains), fontsize=8)
        ax_d.invert_yaxis()
        ax_d.set_xlim(0, 1)
        ax_d.set_xlabel("share of tasks kept")
    else:
        no_data(ax_d)
    fig.suptitle(f"task selection: kept {len(selection['kept'])} of {len(tasks)} tasks", fontsize=11)
    return fig


# ----------------------------------------------------------------------------------------------------
# ARPO vs GRPO


ARM_COLORS = {"grpo": "C1", "arpo": "C0", "arpo_tis": "C2", "arpo_seeded": "C4"}
"""The colours of the published arms; any other arm (`arm_color`) takes the next one unused."""


def arm_color(algo: str) -> str:
    """An arm's colour: the published arms' own (`ARM_COLORS`), any other arm one of the colour
    cycle's remaining colours, fixed by the arm's place in `COMPARISON_ARMS` (a plug-in's arm, the
    served and asynchronous arms), so the same arm has the same colour in every figure."""
    if algo in ARM_COLORS:
        return ARM_COLORS[algo]
    free = [f"C{i}" for i in range(10) if f"C{i}" not in ARM_COLORS.values()]
    others = [n for n in COMPARISON_ARMS if n not in ARM_COLORS]
    return free[(others.index(algo) if algo in others else len(others)) % len(free)]


def _tick(name: str, width: int = 14) -> str:
    """An arm's name under its bar, wrapped so three long names do not run into each other."""
    return "\n".join(textwrap.wrap(name, width)) or name


def _plot_seed_gains(ax: Any, arms: dict[str, Any], label: dict[str, str], bar: float = 0.15) -> None:
    """Training gain over the warm start of every seed (task by task at the training temperature):
    the last quarter's rollouts (dots) and, where measured, the final policy (triangles); a seed
    under `bar` is drawn hollow, so "every seed learned" is read off at a glance."""
    drawn = False
    for x, (algo, arm) in enumerate(arms.items()):
        color = arm_color(algo)
        for dx, key, marker in ((-0.15, "gains_by_seed", "o"), (0.15, "final_gains_by_seed", "^")):
            gains = arm.get(key) or []
            if not gains:
                continue
            drawn = True
            ax.scatter([x + dx] * len(gains), gains, marker=marker, s=22, zorder=3,
                       facecolors=[color if g >= bar else "none" for g in gains], edgecolors=color)
            ax.hlines(sum(gains) / len(gains), x + dx - 0.1, x + dx + 0.1, color="0.2", lw=2)
    if not drawn:
        no_data(ax)
        return
    ax.axhline(bar, color="0.4", ls="--", lw=1, label=f"+{bar:.2f} (the bar)")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="0.3", label="last quarter")
    ax.scatter([], [], marker="^", facecolors="none", edgecolors="0.3", label="final policy")
    ax.set_xticks(range(len(arms)), [_tick(label.get(a, a)) for a in arms], fontsize=8)
    ax.set_title("training gain per seed (hollow: under the bar)", fontsize=10)
    ax.legend(fontsize=7)


def _load_report(report: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A comparison report given as the dict, its report.json, or the experiment directory."""
    if isinstance(report, dict):
        return report
    path = Path(report)
    return json.loads((path / "report.json" if path.is_dir() else path).read_text())


def plot_comparison(report: dict[str, Any] | str | Path) -> Figure:
    """The comparison of `experiments.run_comparison`: training-rollout success and the share of
    all-failed groups per step (mean over seeds, band = bootstrap 95% interval of the mean, moving
    average 3), every seed's training gain over the warm start (last quarter, final policy), final
    evaluation success per arm (mean, interval, every seed), and, with two arms or more, the paired
    differences between arms (every seed, mean and interval, permutation p-value).
    `report`: the dict, report.json, or the experiment dir."""
    report = _load_report(report)
    arms = report["arms"]
    pairs = list((report.get("paired") or {}).items())
    fig = ReportFigure(figsize=(20 if pairs else 16, 3.8), layout="constrained")
    ax_s, ax_f, ax_g, ax_e, *ax_d = fig.subplots(1, 5 if pairs else 4)  # one arm: nothing to pair
    from arpo_lib.viz.report import ARM_LABELS as label
    for x, (algo, arm) in enumerate(arms.items()):
        color = arm_color(algo)
        for ax, key in ((ax_s, "train_success"), (ax_f, "all_failed_groups")):
            rows = (arm.get("curves") or {}).get(key) or []
            if rows:
                steps = list(range(1, len(rows) + 1))
                ax.plot(steps, [r["mean"] for r in rows], color=color, label=label.get(algo, algo))
                ax.fill_between(steps, [r["lo"] for r in rows], [r["hi"] for r in rows], color=color, alpha=0.2)
        e = arm["eval_success"]
        finals = [r["eval"]["success_rate"] for r in report["runs"] if r["algo"] == algo]
        ax_e.bar(x, e["mean"], color=color, alpha=0.45, width=0.6)
        ax_e.errorbar([x], [e["mean"]], yerr=[[e["mean"] - e.get("lo", e["mean"])], [e.get("hi", e["mean"]) - e["mean"]]],
                      color="0.2", capsize=4)
        ax_e.scatter([x] * len(finals), finals, color=color, zorder=3, s=14)
    warm_t = (report.get("warm_start_train_temperature") or report["warm_start_eval"])["success_rate"]
    ax_s.axhline(warm_t, color="0.4", ls="--", lw=1, label=f"warm start {warm_t:.2f}")
    ax_s.set_title("train-rollout success (band: 95% CI)", fontsize=10)
    ax_f.set_title("share of all-failed groups", fontsize=10)
    for ax in (ax_s, ax_f):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
    warm = report["warm_start_eval"]["success_rate"]
    ax_e.axhline(warm, color="0.4", ls="--", lw=1, label=f"warm start {warm:.2f}")
    ax_e.set_xticks(range(len(arms)), [_tick(label.get(a, a)) for a in arms], fontsize=8)
    ax_e.set_ylim(0, 1)
    ax_e.set_title("final evaluation success (95% CI, seeds)", fontsize=10)
    ax_e.legend(fontsize=8)
    _plot_seed_gains(ax_g, arms, label)
    if pairs:
        _plot_paired(ax_d[0], pairs, label)
    fig.suptitle(f"{' vs '.join(label.get(a, a) for a in arms)}: {len(report['tasks'])} tasks, {report['steps']} steps x "
                 f"{report['rollouts_per_step']} rollouts, {len(report['runs'])} runs", fontsize=11)
    return fig


def _plot_paired(ax_d: Any, pairs: list[tuple[str, dict[str, Any]]], label: dict[str, str]) -> None:
    """The paired differences between arms, seed by seed: final evaluation (dots) and, where
    measured, the final policy at the training temperature (triangles), with the mean, its
    interval and the permutation p-values."""
    with_final = any("final_t" in m for _, m in pairs)
    for y, (name, measures) in enumerate(pairs):
        a = name.split("-")[0]
        for dy, key, marker in ((0.0, "eval", "o"), (-0.3, "final_t", "^")):
            d = measures.get(key)
            if d is None:
                continue
            ax_d.scatter(d["differences"], [y + dy] * len(d["differences"]), color=arm_color(a), s=14,
                         marker=marker, zorder=3)
            ax_d.errorbar([d["mean"]], [y + dy], xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], color="0.2",
                          capsize=4, marker=marker)
    ax_d.axvline(0, color="0.4", lw=1)
    names = [[label.get(a, a) for a in n.split("-")] for n, _ in pairs]
    ax_d.set_yticks(range(len(pairs)), [
        f"{a} − {b}\np = {m['eval']['p_permutation']:.3f}"
        + (f" / {m['final_t']['p_permutation']:.3f}" if "final_t" in m else "") for (a, b), (_, m) in zip(names, pairs)],
        fontsize=8)
    ax_d.set_title("paired difference per seed" + ("\n(o final eval, ^ final policy at T=train)" if with_final
                                                   else " in final eval success"), fontsize=10)


def instance_curves(report: dict[str, Any]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Task -> arm -> one row per visit (the k-th batch that drew the task, in every seed): the
    group's training-rollout success averaged over the seeds that visited it k times (`mean`,
    `n` seeds), and a last row `final` (the final policy at the training temperature, where
    measured). Batches draw a few instances per step, so steps do not line up across seeds;
    visits do."""
    curves: dict[str, dict[str, list[dict[str, float]]]] = {}
    for task in report.get("tasks") or []:
        for algo in report.get("arms") or {}:
            per_seed, finals = [], []
            for run in (r for r in report.get("runs") or [] if r["algo"] == algo):
                per_seed.append([_rate(step[task]) for step in run.get("train_success_by_task") or [] if task in step])
                final = (run.get("final_train_t") or {}).get("by_task", {}).get(task)
                if final is not None:
                    finals.append(final)
            rows = []
            for k in range(max((len(v) for v in per_seed), default=0)):
                values = [v[k] for v in per_seed if len(v) > k]
                rows.append({"visit": k + 1, "mean": sum(values) / len(values), "n": len(values)})
            if finals:
                rows.append({"visit": "final", "mean": sum(finals) / len(finals), "n": len(finals)})
            curves.setdefault(task, {})[algo] = rows
    return curves


def _rate(counts: Any) -> float:
    """A step's success of one task: [successes, episodes] as the metrics record it (or a rate)."""
    return counts[0] / counts[1] if isinstance(counts, (list, tuple)) else float(counts)


def plot_instance_curves(report: dict[str, Any] | str | Path, columns: int = 4) -> Figure:
    """One panel per trained instance (`instance_curves`): per arm the training-rollout success
    at each visit (mean over seeds) and the final policy at the training temperature (a marker
    after the last visit), against the warm start's success on it (dashed). Where replay can
    matter, these are the instances it was meant for."""
    report = _load_report(report)
    from arpo_lib.viz.report import ARM_LABELS as label

    curves = instance_curves(report)
    tasks = list(curves) or ["(no task)"]
    rows = math.ceil(len(tasks) / columns)
    fig = ReportFigure(figsize=(3.6 * min(columns, len(tasks)), 2.6 * rows), layout="constrained")
    axes = fig.subplots(rows, min(columns, len(tasks)), squeeze=False).ravel()
    warm = report.get("warm_start_train_by_task") or {}
    for ax, task in zip(axes, tasks):
        for algo, points in curves.get(task, {}).items():
            visits = [r for r in points if r["visit"] != "final"]
            final = [r for r in points if r["visit"] == "final"]
            color = arm_color(algo)
            ax.plot([r["visit"] for r in visits], [r["mean"] for r in visits], color=color, marker=".",
                    label=label.get(algo, algo))
            if final:
                ax.scatter([len(visits) + 1], [final[0]["mean"]], color=color, marker="*", s=60, zorder=3)
        if task in warm:
            ax.axhline(warm[task], color="0.4", ls="--", lw=1)
        ax.set_title(task.split("/")[-1], fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not curves.get(task):
            no_data(ax)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    axes[0].set_ylabel("success per visit")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("per instance: training success at each visit (mean over seeds), * final policy at T=train, "
                 "-- warm start", fontsize=10)
    return fig


# --------------------------------------------------------------------------- live progress
