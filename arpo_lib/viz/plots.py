"""Static figures for training runs and evaluations: the fallback views that survive in a saved notebook.

Every plotting function returns a `matplotlib.figure.Figure` and never calls `plt.show()`, so it works
under the Agg backend, in tests, and in papermill runs. Inputs are what the library writes to disk:
`<run>/metrics.jsonl` (one line per training step, see `training.trainer.Trainer.train_step`) and
`<eval dir>/results.json` (`evaluation.evaluate.EvalResult.to_dict()`).

This module imports neither training nor evaluation: both pull in torch, and looking at a
finished run should not need it.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Sequence, Union

# Figures are built with `Figure` directly, not pyplot: no backend or global figure registry is
# touched, so this works headless, never leaks figures in loops, and a notebook shows the returned
# figure once (pyplot figures would be shown a second time by the inline backend).
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo_lib.envs import domain_of
from arpo_lib.run.records import read_jsonl
from arpo_lib.run import layout


class ReportFigure(Figure):
    """A Figure that shows itself as a PNG in any IPython/Jupyter output.

    Our figures are built without pyplot (headless-safe, never shown twice), so no backend
    registers a display hook for them; this `_repr_png_` makes a bare `plot_training(run)` at
    the end of a cell render, in JupyterLab, Colab, papermill and nbval alike.
    """

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=80)
        return buf.getvalue()

MetricsLike = Union[str, Path, Sequence[dict[str, Any]]]
EvalLike = Union[str, Path, dict[str, Any], Any]

TRAINING_PANELS: tuple[tuple[str, str, str], ...] = (
    # (metrics key, panel title, kind); "eval_success_rate" is drawn only when some run logged it.
    ("success_rate", "success rate (rollouts)", "line"),
    ("mean_reward", "mean reward", "line"),
    ("all_failed_groups", "share of all-failed groups", "line"),
    ("replay_injections", "replay injections", "bar"),
    ("loss", "loss", "line"),
    ("clip_fraction", "clip fraction", "line"),
    ("grad_norm", "grad norm", "line"),
    ("eval_success_rate", "eval success rate", "line"),
)
_OPTIONAL_PANELS = {"eval_success_rate"}
_UNIT_INTERVAL = {"success_rate", "all_failed_groups", "eval_success_rate"}  # shares, drawn on 0..1
_RUN_COLORS = ("C0", "C1")  # run, baseline
_BASELINE_COLOR = "#9ab8d6"  # lighter companion of C0 for baseline bars


# ----------------------------------------------------------------------------------------------------
# Loading


def load_metrics(run_dir_or_path: str | Path) -> list[dict[str, Any]]:
    """Metric records of a run, from a run directory or a `metrics.jsonl` path.

    Unparseable lines are skipped rather than ending the read: a crash can tear the last line, and
    evaluation lines (keys starting with `eval_`) appended by a later trainer must still be picked up.
    """
    path = Path(run_dir_or_path)
    if path.is_dir():
        path = path / layout.METRICS
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return read_jsonl(path)


def load_eval(path: EvalLike) -> dict[str, Any]:
    """An evaluation as a dict: from an eval dir with `results.json`, the json path, a dict, or an EvalResult."""
    if hasattr(path, "to_dict"):
        return path.to_dict()
    if isinstance(path, dict):
        return path
    p = Path(path)
    if p.is_dir():
        p = p / layout.EVAL_RESULTS
    if not p.is_file():
        raise FileNotFoundError(f"no evaluation results at {p}")
    return json.loads(p.read_text())


def _resolve_run(run: MetricsLike, default_name: str) -> tuple[str, list[dict[str, Any]]]:
    """(legend name, records): a directory is named after itself, a metrics file after its directory."""
    if isinstance(run, (str, Path)):
        p = Path(run)
        name = p.name if p.is_dir() else p.parent.name
        return name or default_name, load_metrics(p)
    return default_name, list(run)


# ----------------------------------------------------------------------------------------------------
# Training curves


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over `window` points; the first points average what exists so far (no lag-in gap)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that carry a finite number under `key` and a step.

    Records without `key` are skipped rather than read as 0: evaluation lines and training lines share
    one file, and a metric introduced mid-run should not draw a false drop.
    """
    xs, ys = [], []
    for r in records:
        v, step = r.get(key), r.get("step")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not isinstance(step, (int, float)):
            continue
        if math.isfinite(v):
            xs.append(float(step))
            ys.append(float(v))
    return xs, ys


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")


def plot_training(
    run_or_metrics: MetricsLike,
    *,
    baseline: MetricsLike | None = None,
    smooth: int = 0,
    labels: tuple[str, str] | None = None,
    ncols: int = 4,
) -> Figure:
    """A grid of training curves over step, one panel per entry of `TRAINING_PANELS`.

    `run_or_metrics` / `baseline`: a run directory, a metrics.jsonl path or a list of metric dicts.
    The baseline (e.g. a GRPO run beside an ARPO run) is drawn dashed. Legend names are the run
    directory names, else "run"/"baseline", unless `labels` is given. `smooth` > 1 draws a trailing
    moving average of that many steps over a faint raw line.

    Line order in each line panel, per run (run first, then baseline): the main line (smoothed when
    smoothing), then the faint raw line when smoothing. Bar panels hold one bar container per run.
    The eval panel appears only when some run logged `eval_success_rate`.
    """
    runs = [_resolve_run(run_or_metrics, "run")]
    if baseline is not None:
        runs.append(_resolve_run(baseline, "baseline"))
    if labels is not None:
        runs = [(label, recs) for label, (_, recs) in zip(labels, runs)]

    panels = [p for p in TRAINING_PANELS
              if p[0] not in _OPTIONAL_PANELS or any(series(recs, p[0])[1] for _, recs in runs)]
    ncols = max(1, min(ncols, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    # Constrained layout makes room for the suptitle and the outside legend; tight_layout does not.
    fig = ReportFigure(figsize=(4.2 * ncols, 3.0 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[len(panels):]:
        fig.delaxes(ax)  # removed, not hidden, so fig.axes lists exactly the panels

    steps = [x for _, recs in runs for key, _, _ in panels for x in series(recs, key)[0]]
    for ax, (key, title, kind) in zip(flat, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        drawn = False
        for i, (name, recs) in enumerate(runs):
            xs, ys = series(recs, key)
            if not ys:
                continue
            drawn = True
            style = "--" if i else "-"
            color = _RUN_COLORS[i % len(_RUN_COLORS)]
            if kind == "bar":
                # Side by side when a baseline is present, so equal counts stay visible.
                width = 0.8 / len(runs)
                offset = (i - (len(runs) - 1) / 2) * width
                ax.bar([x + offset for x in xs], ys, width=width, color=color, label=name,
                       alpha=1.0 if i == 0 else 0.6, hatch=None if i == 0 else "//")
                continue
            # Markers keep a 1-step run (a single point) visible.
            marker = "o" if len(xs) <= 30 else None
            ax.plot(xs, moving_average(ys, smooth), style, color=color, label=name, marker=marker,
                    markersize=3)
            if smooth > 1:
                ax.plot(xs, ys, style, color=color, alpha=0.25, linewidth=1, label="_nolegend_")
        if not drawn:
            _no_data(ax)
        if key in _UNIT_INTERVAL:
            # Fixed 0..1 so figures of different runs compare at a glance and noise is not magnified;
            # the small margin keeps points at exactly 0 or 1 from being cut in half by the frame.
            ax.set_ylim(-0.03, 1.03)
        if steps:
            # One step range for every panel: panels line up, and a lone point (a 1-step run, a
            # single eval line) sits on its integer tick instead of in an autoscaled +-0.04 window.
            ax.set_xlim(min(steps) - 0.6, max(steps) + 0.6)
            distinct = sorted(set(steps))
            if len(distinct) <= 10:
                ax.set_xticks(distinct)
    if len(runs) > 1 or runs[0][0] != "run":
        handles, names = [], []
        for ax in fig.axes:
            h, n = ax.get_legend_handles_labels()
            for hh, nn in zip(h, n):
                if nn not in names:
                    handles.append(hh)
                    names.append(nn)
        if handles:
            fig.legend(handles, names, loc="outside upper right", fontsize=9, ncol=len(names))
    title = " vs ".join(name for name, _ in runs)
    fig.suptitle(f"training: {title}" + (f" (moving average {smooth})" if smooth > 1 else ""),
                 fontsize=12)
    return fig


# ----------------------------------------------------------------------------------------------------
# Evaluation


def _task_table(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["task"]: t for t in result.get("tasks", [])}


def _per_domain(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{domain: (success rate, pass@k)}.

    Success comes from `per_domain` (episode-weighted, as `evaluate.summarize` computes it) when
    present, else from the tasks weighted by samples; pass@k is the mean of the tasks' pass@k.
    """
    grouped: dict[str, list[dict[str, Any]]] = {}
    for t in result.get("tasks", []):
        grouped.setdefault(domain_of(t["task"]), []).append(t)
    stored = result.get("per_domain") or {}
    out = {}
    for domain in list(stored) + [d for d in grouped if d not in stored]:
        tasks = grouped.get(domain, [])
        samples = sum(t.get("samples", 0) for t in tasks)
        if domain in stored:
            success = float(stored[domain])
        else:
            success = sum(t["success_rate"] * t.get("samples", 0) for t in tasks) / samples if samples else 0.0
        pass_k = sum(t.get("pass_at_k", 0.0) for t in tasks) / len(tasks) if tasks else float("nan")
        out[domain] = (success, pass_k)
    return out


def _eval_panel(
    ax: Any,
    names: list[str],
    ours: dict[str, tuple[float, float]],
    base: dict[str, tuple[float, float]] | None,
    labels: tuple[str, str],
    what: str,
) -> None:
    """Horizontal bars (long task names stay readable): success per row, pass@k as diamond markers.

    Containers: [trained] or [trained, baseline]. Lines: pass@k markers of trained, then baseline.
    Rows present on only one side are drawn with the other at 0 and their tick label says so.
    """
    n = len(names)
    if n == 0:
        _no_data(ax)
        ax.set_title(f"success per {what}", fontsize=10)
        return
    height = 0.8 if base is None else 0.4
    ys = list(range(n))
    sides = [(labels[0], ours, 0.0 if base is None else -height / 2, dict(color="C0"))]
    if base is not None:
        sides.append((labels[1], base, height / 2,
                      dict(color=_BASELINE_COLOR, hatch="//", edgecolor="white")))
    for label, values, offset, style in sides:
        succ = [values.get(k, (0.0, 0.0))[0] for k in names]
        ax.barh([y + offset for y in ys], succ, height=height, label=label, **style)
    for (label, values, offset, _), marker_color in zip(sides, ("navy", "0.35")):
        pk = [(values[k][1], y + offset) for y, k in enumerate(names)
              if k in values and not math.isnan(values[k][1])]
        ax.plot([p for p, _ in pk], [y for _, y in pk], linestyle="none", marker="D", markersize=4,
                color=marker_color, label=f"pass@k ({label})")
        if n <= 40:
            # Value to the right of both bar and marker, so neither hides the number.
            for y, k in enumerate(names):
                succ_k, pk_k = values.get(k, (0.0, float("nan")))
                if math.isnan(pk_k):
                    right, text = succ_k, f"{succ_k:.2f}"
                else:
                    right, text = max(succ_k, pk_k), f"{succ_k:.2f} (pass@k {pk_k:.2f})"
                ax.text(right + 0.02, y + offset, text, va="center", fontsize=7)
    ticks = []
    for k in names:
        if base is not None and k not in base:
            ticks.append(f"{k}  [only {labels[0]}]")
        elif base is not None and k not in ours:
            ticks.append(f"{k}  [only {labels[1]}]")
        else:
            ticks.append(k)
    ax.set_yticks(ys)
    ax.set_yticklabels(ticks, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)  # inverted: first row on top, in the order of the results file
    ax.set_xlim(0, 1.4)  # room for the value labels right of a full bar or pass@k marker
    ax.set_xlabel("success rate", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"success per {what}", fontsize=10)
    # Outside the axes: inside, it would cover the bars of whichever rows sit under it.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def plot_eval(
    result: EvalLike,
    *,
    baseline: EvalLike | None = None,
    by: str = "task",
    labels: tuple[str, str] = ("trained", "baseline"),
) -> Figure:
    """Success rate per task and/or per domain (`by` = "task" | "domain" | "both"), pass@k as markers.

    `result`/`baseline`: an eval dir, a results.json path, a dict or an EvalResult. With a baseline
    the two are drawn side by side (baseline lighter and hatched). Overall success is in the title.
    """
    if by not in ("task", "domain", "both"):
        raise ValueError(f"by must be 'task', 'domain' or 'both', not {by!r}")
    ours_d = load_eval(result)
    base_d = load_eval(baseline) if baseline is not None else None

    panels: list[tuple[str, list[str], dict, dict | None]] = []
    if by in ("task", "both"):
        ours_t = {k: (t["success_rate"], t.get("pass_at_k", float("nan"))) for k, t in _task_table(ours_d).items()}
        base_t = ({k: (t["success_rate"], t.get("pass_at_k", float("nan")))
                   for k, t in _task_table(base_d).items()} if base_d is not None else None)
        names = list(ours_t) + [k for k in (base_t or {}) if k not in ours_t]
        panels.append(("task", names, ours_t, base_t))
    if by in ("domain", "both"):
        ours_dm = _per_domain(ours_d)
        base_dm = _per_domain(base_d) if base_d is not None else None
        names = list(ours_dm) + [k for k in (base_dm or {}) if k not in ours_dm]
        panels.append(("domain", names, ours_dm, base_dm))

    # Height grows with the rows so a 300-task OSWorld evaluation stays legible.
    heights = [max(1.5, 0.35 * len(names) * (2 if base_d is not None else 1) + 1.0) for _, names, _, _ in panels]
    longest = max((len(n) for _, names, _, _ in panels for n in names), default=10)
    width = min(16.0, 6.0 + 0.07 * longest)
    fig = ReportFigure(figsize=(width, sum(heights) + 0.8), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, (what, names, ours_v, base_v) in zip(axes[:, 0], panels):
        _eval_panel(ax, names, ours_v, base_v, labels, what)

    title = f"{labels[0]}: success {ours_d.get('success_rate', 0.0):.2f}, pass@k {ours_d.get('pass_at_k', 0.0):.2f}"
    if base_d is not None:
        delta = ours_d.get("success_rate", 0.0) - base_d.get("success_rate", 0.0)
        title += (f"   |   {labels[1]}: success {base_d.get('success_rate', 0.0):.2f}, "
                  f"pass@k {base_d.get('pass_at_k', 0.0):.2f}   |   delta {delta:+.2f}")
    fig.suptitle(title, fontsize=11)
    return fig


def compare_eval(result: EvalLike, baseline: EvalLike, *, labels: tuple[str, str] = ("trained", "baseline")) -> str:
    """Plain-text table: per-task success (ours, baseline, delta), overall success and pass@k, per domain.

    A task evaluated on only one side shows "-" on the other and no delta: a missing task is not a
    failed one, and a delta against it would mislead.
    """
    ours, base = load_eval(result), load_eval(baseline)
    ours_t, base_t = _task_table(ours), _task_table(base)
    names = list(ours_t) + [k for k in base_t if k not in ours_t]
    ours_dm, base_dm = _per_domain(ours), _per_domain(base)
    domains = list(ours_dm) + [d for d in base_dm if d not in ours_dm]
    width = max([24] + [len(n) for n in names] + [len(d) + 7 for d in domains])
    col = max(9, len(labels[0]) + 1, len(labels[1]) + 1)

    def fmt(v: float | None) -> str:
        return f"{v:>{col}.2f}" if v is not None else f"{'-':>{col}}"

    def row(name: str, a: float | None, b: float | None) -> str:
        delta = f"{a - b:>+{col}.2f}" if a is not None and b is not None else f"{'-':>{col}}"
        return f"{name:<{width}} {fmt(a)} {fmt(b)} {delta}"

    head = f"{'task':<{width}} {labels[0]:>{col}} {labels[1]:>{col}} {'delta':>{col}}"
    rule = "-" * len(head)
    lines = [head, rule]
    for n in names:
        lines.append(row(n, ours_t[n]["success_rate"] if n in ours_t else None,
                         base_t[n]["success_rate"] if n in base_t else None))
    lines.append(rule)
    lines.append(row("all (success)", ours.get("success_rate"), base.get("success_rate")))
    lines.append(row("all (pass@k)", ours.get("pass_at_k"), base.get("pass_at_k")))
    lines.append(rule)
    for d in domains:
        lines.append(row(f"domain {d}", ours_dm[d][0] if d in ours_dm else None,
                         base_dm[d][0] if d in base_dm else None))
    only = [n for n in names if (n in ours_t) != (n in base_t)]
    if only:
        lines.append(f"({len(only)} task(s) evaluated on one side only: {', '.join(only)})")
    return "\n".join(mixing_warnings(ours, base, labels) + lines)


def mixing_warnings(ours: dict[str, Any], base: dict[str, Any], labels: tuple[str, str]) -> list[str]:
    """WARNING lines when two evaluations were not measured the same way: another protocol, or
    OSWorld episodes scored by another desktop_env (the fork's checkers are not PyPI's)."""
    from arpo_lib.envs.osworld.build_info import same_build

    out = []
    if ours.get("protocol", "run") != base.get("protocol", "run"):
        out.append(f"WARNING: {labels[0]} was measured under protocol {ours.get('protocol', 'run')!r}, "
                   f"{labels[1]} under {base.get('protocol', 'run')!r}: the numbers are not comparable")
    a, b = ours.get("desktop_env"), base.get("desktop_env")
    if (a or b) and not same_build(a, b):
        def name(d: dict[str, Any] | None) -> str:
            return d.get("label", "?") if d else "not recorded"
        out.append(f"WARNING: the OSWorld checkers differ: {labels[0]} scored by {name(a)}, {labels[1]} by "
                   f"{name(b)}: the scores are not comparable")
    return out


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG (dpi 100, tight bounding box), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


# ----------------------------------------------------------------------------------------------------
# Task selection


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
        _no_data(ax_d)
    fig.suptitle(f"task selection: kept {len(selection['kept'])} of {len(tasks)} tasks", fontsize=11)
    return fig


# ----------------------------------------------------------------------------------------------------
# ARPO vs GRPO


ARM_COLORS = {"grpo": "C1", "arpo": "C0", "arpo_tis": "C2", "arpo_seeded": "C4"}


def _plot_seed_gains(ax: Any, arms: dict[str, Any], label: dict[str, str], bar: float = 0.15) -> None:
    """Training gain over the warm start of every seed (task by task at the training temperature):
    the last quarter's rollouts (dots) and, where measured, the final policy (triangles); a seed
    under `bar` is drawn hollow, so "every seed learned" is read off at a glance."""
    drawn = False
    for x, (algo, arm) in enumerate(arms.items()):
        color = ARM_COLORS.get(algo)
        for dx, key, marker in ((-0.15, "gains_by_seed", "o"), (0.15, "final_gains_by_seed", "^")):
            gains = arm.get(key) or []
            if not gains:
                continue
            drawn = True
            ax.scatter([x + dx] * len(gains), gains, marker=marker, s=22, zorder=3,
                       facecolors=[color if g >= bar else "none" for g in gains], edgecolors=color)
            ax.hlines(sum(gains) / len(gains), x + dx - 0.1, x + dx + 0.1, color="0.2", lw=2)
    if not drawn:
        _no_data(ax)
        return
    ax.axhline(bar, color="0.4", ls="--", lw=1, label=f"+{bar:.2f} (the bar)")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="0.3", label="last quarter")
    ax.scatter([], [], marker="^", facecolors="none", edgecolors="0.3", label="final policy")
    ax.set_xticks(range(len(arms)), [label.get(a, a) for a in arms])
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
        color = ARM_COLORS.get(algo)
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
    ax_e.set_xticks(range(len(arms)), [label.get(a, a) for a in arms])
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
            ax_d.scatter(d["differences"], [y + dy] * len(d["differences"]), color=ARM_COLORS.get(a), s=14,
                         marker=marker, zorder=3)
            ax_d.errorbar([d["mean"]], [y + dy], xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], color="0.2",
                          capsize=4, marker=marker)
    ax_d.axvline(0, color="0.4", lw=1)
    ax_d.set_yticks(range(len(pairs)), [
        f"{label.get(n.split('-')[0])} − {label.get(n.split('-')[1])}\np = {m['eval']['p_permutation']:.3f}"
        + (f" / {m['final_t']['p_permutation']:.3f}" if "final_t" in m else "") for n, m in pairs], fontsize=8)
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
            color = ARM_COLORS.get(algo)
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
            _no_data(ax)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    axes[0].set_ylabel("success per visit")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("per instance: training success at each visit (mean over seeds), * final policy at T=train, "
                 "-- warm start", fontsize=10)
    return fig


# --------------------------------------------------------------------------- live progress

def live_training_figure(records: Sequence[dict[str, Any]]) -> Figure:
    """One panel for a run in progress: training success per step (line), evaluation success
    where the run evaluated (markers), replay injections per step (bars, right axis)."""
    fig = ReportFigure(figsize=(7.5, 3.0), layout="constrained")
    ax = fig.subplots()
    steps = [int(m["step"]) for m in records]
    ax.plot(steps, [float(m.get("success_rate", 0.0)) for m in records], marker=".", color="C0",
            label="training success")
    evals = [(int(m["step"]), float(m["eval_success_rate"])) for m in records if "eval_success_rate" in m]
    if evals:
        ax.plot(*zip(*evals), marker="o", linestyle="--", color="C2", label="evaluation success")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("success", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    bars = ax.twinx()
    bars.bar(steps, [int(m.get("replay_injections", 0)) for m in records], color="C3", alpha=0.3, width=0.6,
             label="replay injections")
    bars.set_ylabel("injections", fontsize=8)
    bars.yaxis.set_major_locator(MaxNLocator(integer=True))
    bars.tick_params(labelsize=8)
    lines, names = ax.get_legend_handles_labels()
    more, more_names = bars.get_legend_handles_labels()
    ax.legend(lines + more, names + more_names, fontsize=7, loc="upper left")
    last = records[-1] if records else {}
    fig.suptitle(f"step {last.get('step', 0)}: success {float(last.get('success_rate', 0.0)):.2f}, "
                 f"{sum(int(m.get('replay_injections', 0)) for m in records)} injections so far", fontsize=9)
    return fig


class LiveTraining:
    """A trainer's `on_step` callback that redraws `live_training_figure` in place after every
    step (one output that updates, in JupyterLab, Colab and papermill alike), then calls `then`
    (e.g. `workflows.print_step`). Steps done before (a resumed run) are read from `run_dir`."""

    def __init__(self, run_dir: str | Path | None = None, then: Any = None, display: Any = None):
        if display is None:
            from IPython.display import display
        self._display, self.then = display, then
        self.records: list[dict[str, Any]] = []
        if run_dir is not None and layout.RunDir(Path(run_dir)).metrics.is_file():
            self.records = list(read_jsonl(layout.RunDir(Path(run_dir)).metrics))
        self.handle: Any = None
        self.figure: Figure | None = None
        """The figure last shown."""

    def __call__(self, metrics: dict[str, Any]) -> None:
        from IPython.display import Image

        self.records.append(metrics)
        self.figure = live_training_figure(self.records)
        png = Image(data=self.figure._repr_png_())  # PNG bytes: every front end and a saved notebook show them
        if self.handle is None:
            self.handle = self._display(png, display_id=True)
        else:
            self.handle.update(png)
        if self.then is not None:
            self.then(metrics)
