"""Figures for training runs and evaluations, checked on hand-made metrics and results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from arpo_lib.viz import plots
from arpo_lib.evaluation.evaluate import EvalResult, TaskResult

KEYS = ("success_rate", "mean_reward", "all_failed_groups", "replay_injections", "loss",
        "clip_fraction", "grad_norm")


def metrics(n: int, scale: float = 1.0) -> list[dict]:
    """n training lines with distinct, hand-checkable values per key."""
    return [{"step": s, "success_rate": 0.1 * s * scale, "mean_reward": -1 + 0.2 * s * scale,
             "all_failed_groups": 1 - 0.1 * s, "replay_injections": s % 3, "loss": 0.5 / s,
             "clip_fraction": 0.01 * s, "grad_norm": 1.0 + s} for s in range(1, n + 1)]


def write_run(root: Path, name: str, records: list[dict], torn: bool = False) -> Path:
    run = root / name
    run.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + ('{"step": 99, "loss"' if torn else ""))
    return run


def panel(fig: Figure, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def titles() -> dict[str, str]:
    return {key: title for key, title, _ in plots.TRAINING_PANELS}


def task(name: str, succ: float, pass_k: float, samples: int = 4) -> dict:
    return {"task": name, "samples": samples, "successes": round(succ * samples), "success_rate": succ,
            "pass_at_k": pass_k, "mean_score": succ, "mean_steps": 3.0, "format_error_rate": 0.0,
            "env_errors": 0}


def result(tasks: list[dict], success: float, pass_k: float, per_domain: dict[str, float]) -> dict:
    return {"tasks": tasks, "success_rate": success, "pass_at_k": pass_k, "mean_steps": 3.0,
            "format_error_rate": 0.0, "env_errors": 0, "episodes": 4 * len(tasks), "seconds": 1.0,
            "env_steps": 10, "per_domain": per_domain}


@pytest.fixture
def trained() -> dict:
    return result([task("chrome/a", 0.75, 1.0), task("chrome/b", 0.25, 1.0), task("gimp/c", 0.5, 1.0)],
                  0.5, 1.0, {"chrome": 0.5, "gimp": 0.5})


@pytest.fixture
def base() -> dict:
    return result([task("chrome/a", 0.5, 1.0), task("chrome/b", 0.0, 0.0), task("vlc/d", 1.0, 1.0)],
                  0.5, 2 / 3, {"chrome": 0.25, "vlc": 1.0})


# ---------------------------------------------------------------------------------------------------
# load_metrics / load_eval


def test_load_metrics_from_dir_or_file_ignores_torn_line_and_keeps_eval_lines(tmp_path: Path) -> None:
    records = metrics(3) + [{"step": 3, "eval_success_rate": 0.4}]
    run = write_run(tmp_path, "arpo", records, torn=True)
    assert plots.load_metrics(run) == records
    assert plots.load_metrics(run / "metrics.jsonl") == records
    with pytest.raises(FileNotFoundError):
        plots.load_metrics(tmp_path / "missing")


def test_load_eval_accepts_dir_path_dict_and_evalresult(tmp_path: Path, trained: dict) -> None:
    (tmp_path / "results.json").write_text(json.dumps(trained))
    assert plots.load_eval(tmp_path) == trained
    assert plots.load_eval(tmp_path / "results.json") == trained
    assert plots.load_eval(trained) is trained
    obj = EvalResult(tasks=[TaskResult(**t) for t in trained["tasks"]], success_rate=0.5, pass_at_k=1.0,
                     per_domain={"chrome": 0.5, "gimp": 0.5})
    assert plots.load_eval(obj)["tasks"][0]["task"] == "chrome/a"


# ---------------------------------------------------------------------------------------------------
# plot_training


def test_training_panels_plot_the_input_values() -> None:
    recs = metrics(4)
    fig = plots.plot_training(recs)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 7  # no eval panel without eval lines; the spare grid cell is removed
    for key, title, kind in plots.TRAINING_PANELS[:7]:
        ax = panel(fig, title)
        want = [r[key] for r in recs]
        if kind == "bar":
            assert [p.get_height() for p in ax.containers[0]] == want
        else:
            assert list(ax.lines[0].get_xdata()) == [1, 2, 3, 4]
            assert list(ax.lines[0].get_ydata()) == pytest.approx(want)


def test_baseline_overlay_is_dashed_and_named_after_run_dirs(tmp_path: Path) -> None:
    arpo = write_run(tmp_path, "arpo", metrics(3))
    grpo = write_run(tmp_path, "grpo", metrics(3, scale=0.5))
    fig = plots.plot_training(arpo, baseline=grpo / "metrics.jsonl")
    ax = panel(fig, titles()["success_rate"])
    assert len(ax.lines) == 2
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    assert list(ax.lines[1].get_ydata()) == pytest.approx([0.05, 0.1, 0.15])
    assert ax.lines[0].get_linestyle() == "-" and ax.lines[1].get_linestyle() == "--"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["arpo", "grpo"]
    bars = panel(fig, titles()["replay_injections"])
    assert len(bars.containers) == 2  # side by side, one container per run


def test_lists_get_default_names_or_given_labels() -> None:
    fig = plots.plot_training(metrics(2), baseline=metrics(2))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run", "baseline"]
    fig = plots.plot_training(metrics(2), baseline=metrics(2), labels=("ARPO", "GRPO"))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ARPO", "GRPO"]


def test_smoothing_draws_trailing_mean_over_raw_line() -> None:
    fig = plots.plot_training(metrics(4), smooth=2)
    ax = panel(fig, titles()["grad_norm"])  # raw 2, 3, 4, 5
    assert list(ax.lines[0].get_ydata()) == pytest.approx([2.0, 2.5, 3.5, 4.5])
    assert list(ax.lines[1].get_ydata()) == pytest.approx([2.0, 3.0, 4.0, 5.0])
    assert plots.moving_average([1.0, 2.0, 3.0, 4.0], 3) == pytest.approx([1.0, 1.5, 2.0, 3.0])


def test_eval_lines_add_a_panel_without_disturbing_training_curves() -> None:
    # The trainer merges eval_* keys into its step line; a separate eval line must work too.
    recs = metrics(3) + [{"step": 2, "eval_success_rate": 0.3}]
    recs[2] = recs[2] | {"eval_success_rate": 0.6, "eval_pass_at_k": 1.0}
    recs = recs[:2] + [recs[3], recs[2]]
    fig = plots.plot_training(recs)
    assert len(fig.axes) == 8
    assert list(panel(fig, titles()["eval_success_rate"]).lines[0].get_ydata()) == pytest.approx([0.3, 0.6])
    assert list(panel(fig, titles()["loss"]).lines[0].get_xdata()) == [1, 2, 3]


def test_one_step_run_and_missing_keys(tmp_path: Path) -> None:
    recs = [{"step": 1, "success_rate": 0.5, "loss": float("nan")}]
    fig = plots.plot_training(write_run(tmp_path, "short", recs))
    assert list(panel(fig, titles()["success_rate"]).lines[0].get_ydata()) == [0.5]
    for key in ("loss", "grad_norm", "replay_injections"):
        ax = panel(fig, titles()[key])
        assert not ax.lines and not ax.containers
        assert [t.get_text() for t in ax.texts] == ["no data"]
    plots.save_figure(fig, tmp_path / "out" / "deep" / "short.png")
    assert (tmp_path / "out" / "deep" / "short.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------------
# plot_eval / compare_eval


def test_eval_bars_are_success_rates_with_pass_at_k_markers(trained: dict) -> None:
    fig = plots.plot_eval(trained)
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.containers[0]] == [0.75, 0.25, 0.5]  # horizontal bars
    assert list(ax.lines[0].get_xdata()) == [1.0, 1.0, 1.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["chrome/a", "chrome/b", "gimp/c"]
    assert "success 0.50" in fig.get_suptitle()


def test_eval_with_baseline_shows_both_and_marks_one_sided_tasks(trained: dict, base: dict) -> None:
    fig = plots.plot_eval(trained, baseline=base, by="both", labels=("ARPO", "UI-TARS"))
    assert len(fig.axes) == 2
    tasks_ax, domains_ax = fig.axes
    assert [p.get_width() for p in tasks_ax.containers[0]] == [0.75, 0.25, 0.5, 0.0]
    assert [p.get_width() for p in tasks_ax.containers[1]] == [0.5, 0.0, 0.0, 1.0]
    ticks = [t.get_text() for t in tasks_ax.get_yticklabels()]
    assert ticks[:2] == ["chrome/a", "chrome/b"]
    assert "only ARPO" in ticks[2] and "only UI-TARS" in ticks[3]
    assert [t.get_text() for t in tasks_ax.get_legend().get_texts()][-2:] == ["ARPO", "UI-TARS"]
    # Domains: chrome, gimp (ours), vlc (baseline only); success from per_domain.
    assert [p.get_width() for p in domains_ax.containers[0]] == [0.5, 0.5, 0.0]
    assert [p.get_width() for p in domains_ax.containers[1]] == [0.25, 0.0, 1.0]
    assert "UI-TARS: success 0.50" in fig.get_suptitle()
    assert len(plots.plot_eval(trained, baseline=base, by="domain").axes) == 1
    with pytest.raises(ValueError, match="by must be"):
        plots.plot_eval(trained, by="tasks")


def test_compare_eval_table_numbers(trained: dict, base: dict, tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "results.json").write_text(json.dumps(base))
    table = plots.compare_eval(trained, tmp_path / "base")
    rows = {line[:30].strip(): line[30:].split() for line in table.splitlines()}
    assert rows["chrome/a"] == ["0.75", "0.50", "+0.25"]
    assert rows["chrome/b"] == ["0.25", "0.00", "+0.25"]
    assert rows["gimp/c"] == ["0.50", "-", "-"]  # missing on one side: no delta
    assert rows["vlc/d"] == ["-", "1.00", "-"]
    assert rows["all (success)"] == ["0.50", "0.50", "+0.00"]
    assert rows["all (pass@k)"] == ["1.00", "0.67", "+0.33"]
    assert rows["domain chrome"] == ["0.50", "0.25", "+0.25"]
    assert rows["domain vlc"] == ["-", "1.00", "-"]


def test_the_live_curve_redraws_one_output_per_step_with_success_evaluation_and_injections(tmp_path: Path) -> None:
    """The training notebooks' on_step shows one figure that updates in place, with
    what each step reported; a resumed run's earlier steps are read from its metrics.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "success_rate": 0.25, "replay_injections": 0}) + "\n")
    shown, lines = [], []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def display(obj, display_id=False):
        assert display_id is True  # an output that can be updated
        shown.append(("display", obj))
        return Handle()

    live = plots.LiveTraining(run, then=lambda m: lines.append(m["step"]), display=display)
    live({"step": 2, "success_rate": 0.5, "replay_injections": 2})
    live({"step": 3, "success_rate": 0.75, "replay_injections": 1, "eval_success_rate": 0.6})
    assert [kind for kind, _ in shown] == ["display", "update"] and lines == [2, 3]
    assert all(obj.data[:4] == b"\x89PNG" for _, obj in shown)  # an image, so a saved notebook keeps it
    fig = live.figure
    assert isinstance(fig, Figure)
    ax, bars = fig.axes
    success, evaluation = ax.get_lines()
    assert list(success.get_xdata()) == [1, 2, 3] and list(success.get_ydata()) == [0.25, 0.5, 0.75]
    assert list(evaluation.get_xdata()) == [3] and list(evaluation.get_ydata()) == [0.6]
    assert [p.get_height() for p in bars.patches] == [0, 2, 1]
    assert "3 injections so far" in fig._suptitle.get_text()


def test_a_run_without_evaluations_says_so_instead_of_failing(tmp_path: Path, capsys) -> None:
    """The subset-training notebook's evaluation cell on a run with train.eval_every 0 (the one-GPU
    and OSWorld configs): a line naming the setting, no figure, no IndexError."""
    from arpo_lib import workflows

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    assert workflows.plot_run_evals(run) is None
    assert "train.eval_every is 0" in capsys.readouterr().out
