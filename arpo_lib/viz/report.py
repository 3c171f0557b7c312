"""The comparison's report as text: `report_markdown` (the tables of report.md) and
`report_digest` (the seed-determined lines nbval compares), from the report dict that
`experiments.comparison_report` makes (its figure is `viz.plots.plot_comparison`)."""
from __future__ import annotations

from typing import Any

from arpo_lib.evaluation.stats import train_quarter

ARM_LABELS = {"grpo": "GRPO", "arpo": "ARPO", "arpo_tis": "ARPO+TIS"}
"""How the tables name an arm (`compare.algos`); an arm not named here shows its own name."""

PAIRED_LABELS = {"eval": "final eval success", "train": "train success, last quarter",
                 "final_t": "final policy at T=train"}
"""How the paired table names each of `evaluation.stats.PAIRED_MEASURES`."""


def report_markdown(report: dict[str, Any]) -> str:
    """report.md: per arm the means over seeds with their intervals; the gains seed by seed; the
    paired differences between arms; training success per task; one row per run. A partial
    report (`missing_runs`) says so under its title."""
    w = report["warm_start_eval"]["success_rate"]
    wt = (report.get("warm_start_train_temperature") or report["warm_start_eval"])["success_rate"]
    temps = report["eval"]
    lines = [f"# {' vs '.join(ARM_LABELS.get(a, a) for a in report['arms'])} from one warm start "
             f"({len(report['tasks'])} tasks, {report['steps']} steps x {report['rollouts_per_step']} rollouts)", "",
             f"Evaluation protocol `{temps.get('protocol', 'run')}`. "
             f"Warm start (SFT): evaluation success **{w:.3f}** at temperature {temps['temperature']} "
             f"({report['warm_start_eval']['episodes']} episodes, seed {temps['seed']}); "
             f"**{wt:.3f}** at the training temperature {temps.get('train_temperature', 1.0)}.", "",
             "Means over seeds with bootstrap 95% intervals.", "",
             "| arm | seeds | final eval success | gain over warm start | train success, first → last quarter | "
             "last-quarter gain over warm start (T=train) | every seed +15 pts | all-failed groups | injections |",
             "|---|---|---|---|---|---|---|---|---|"]
    for algo, a in report["arms"].items():
        e, g, f, last = a["eval_success"], a["eval_gain_over_warm_start"], a["train_success_first_quarter"], \
            a["train_success_last_quarter"]
        tg = a.get("train_gain_over_warm_start", {"mean": last["mean"] - wt, "lo": 0.0, "hi": 0.0})
        lines.append(f"| {ARM_LABELS.get(algo, algo)} | {len(a['seeds'])} | {e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] | "
                     f"{g['mean']:+.3f} | {f['mean']:.3f} → {last['mean']:.3f} | "
                     f"{tg['mean']:+.3f} [{tg['lo']:+.3f}, {tg['hi']:+.3f}] | "
                     f"{'yes' if a.get('every_seed_gained_15_points') else 'no'} | {a['all_failed_share']['mean']:.2f} | "
                     f"{a['replay_injections']['mean']:.1f} |")
    arms_all = report["arms"]
    if any(a.get("gains_by_seed") for a in arms_all.values()):
        with_final = any(a.get("final_gains_by_seed") for a in arms_all.values())
        lines += ["", "Training gain over the warm start per seed, task by task at the training temperature: "
                  "last quarter of the training rollouts" + (
                      "; and the final policy run on the training tasks with the baseline's episodes "
                      "(`compare.final_at_train_temperature`)" if with_final else "") + ".", ""]
        seeds = sorted({seed for a in arms_all.values() for seed in a["seeds"]})  # arms may lag (partial report)
        lines += ["| arm | measure | " + " | ".join(f"s{seed}" for seed in seeds) + " | mean [95% CI] | every seed +15 pts |",
                  "|---|---|" + "---|" * (len(seeds) + 2)]
        for algo, a in arms_all.items():
            rows = [("last quarter", a.get("gains_by_seed"), a.get("train_gain_over_warm_start"),
                     a.get("every_seed_gained_15_points")),
                    ("final policy", a.get("final_gains_by_seed"), a.get("final_gain_over_warm_start"),
                     a.get("every_seed_final_gained_15_points"))]
            for label, gains, st, every in rows:
                if not gains:
                    continue
                by_seed = dict(zip(a["seeds"], gains))
                cells = ["–" if seed not in by_seed else
                         (f"**{by_seed[seed]:+.3f}**" if by_seed[seed] < 0.15 else f"{by_seed[seed]:+.3f}") for seed in seeds]
                lines.append(f"| {ARM_LABELS.get(algo, algo)} | {label} | " + " | ".join(cells) +
                             f" | {st['mean']:+.3f} [{st['lo']:+.3f}, {st['hi']:+.3f}] | {'yes' if every else 'no'} |")
    if report.get("paired"):
        lines += ["", "Paired differences (same seed: same first batch, task order and evaluation episodes):", "",
                  "| comparison | measure | mean difference [95% CI] | seeds a > b / a < b / equal | p (permutation) | p (sign) |",
                  "|---|---|---|---|---|---|"]
        for name, measures in report["paired"].items():
            a, b = name.split("-")
            for measure, d in measures.items():
                diffs = d["differences"]
                wins, losses = sum(x > 0 for x in diffs), sum(x < 0 for x in diffs)
                lines.append(f"| {ARM_LABELS.get(a, a)} − {ARM_LABELS.get(b, b)} | {PAIRED_LABELS[measure]} | "
                             f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | "
                             f"{wins} / {losses} / {len(diffs) - wins - losses} | "
                             f"{d['p_permutation']:.3f} | {d['p_sign']:.3f} |")
    by_task = report.get("warm_start_train_by_task") or {}
    if by_task and any(a.get("train_last_quarter_by_task") for a in report["arms"].values()):
        arms = list(report["arms"])
        lines += ["", "Training success per task at the training temperature: the warm start, and each arm's "
                  "last quarter (mean over seeds). The gains above are these differences averaged over tasks.", "",
                  "| task | warm start | " + " | ".join(ARM_LABELS.get(a, a) for a in arms) + " |",
                  "|---|---|" + "---|" * len(arms)]
        for task, rate in by_task.items():
            cells = [report["arms"][a].get("train_last_quarter_by_task", {}).get(task) for a in arms]
            lines.append(f"| {task} | {rate:.3f} | " + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    final_col = any(r.get("final_train_t") for r in report["runs"])
    lines += ["", "| run | final eval success | train success (last quarter) | "
              + ("final policy at T=train | " if final_col else "") + "injections | seconds |",
              "|---|---|---|" + ("---|" if final_col else "") + "---|---|"]
    for r in sorted(report["runs"], key=lambda r: (r["algo"], r["seed"])):
        final_cell = ""
        if final_col:
            final_cell = f"{r['final_train_t']['success_rate']:.3f} | " if r.get("final_train_t") else "– | "
        lines.append(f"| {r['algo']}-s{r['seed']} | {r['eval']['success_rate']:.3f} | "
                     f"{train_quarter(r, True):.3f} | {final_cell}{sum(r['replay_injections'])} | {r['seconds']} |")
    lines += ["", f"Tasks: {', '.join(report['tasks'])}"]
    if report.get("missing_runs"):
        lines[1:1] = ["", f"**Partial report: {len(report['missing_runs'])} run(s) not finished** "
                      f"({', '.join(report['missing_runs'])}); the figures cover the finished ones only."]
    return "\n".join(lines) + "\n"


def report_digest(report: dict[str, Any]) -> str:
    """The seed-determined numbers of a comparison, rounded (what nbval compares)."""
    rows = [f"warm start eval {report['warm_start_eval']['success_rate']:.3f}, tasks kept {len(report['tasks'])}"]
    for r in report["runs"]:
        rows.append(f"{r['algo']}-s{r['seed']}: eval {r['eval']['success_rate']:.3f}, "
                    f"injections {sum(r['replay_injections'])}")
    return "\n".join(rows)
