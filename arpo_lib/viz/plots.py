"""Static figures for training runs and evaluations: the fallback views that survive in a saved notebook.

Every plotting function returns a `matplotlib.figure.Figure` and never calls `plt.show()`, so it works
under the Agg backend, in tests, and in papermill runs. Inputs are what the library writes to disk:
`<run>/metrics.jsonl` (one line per training step, see `training.trainer.Trainer.train_step`) and
`<eval dir>/results.json` (`evaluation.evaluate.EvalResult.to_dict()`).

This module imports neither training nor evaluation: both pull in torch, and looking at a
finished run should not need it.
"""
from __future__ import annotations

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
from arpo_lib.viz.figures import ReportFigure, no_data, save_figure  # noqa: F401 (save_figure: the notebooks' name)
# The study's figures live in study_plots; the notebooks reach them as `plots.plot_comparison`, ...
from arpo_lib.viz.study_plots import instance_curves, plot_comparison, plot_instance_curves, plot_selection  # noqa: F401


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
            no_data(ax)
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
        no_data(ax)
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


# ----------------------------------------------------------------------------------------------------
# Task selection


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
