"""The comparison's report as text: `report_markdown` (the tables of report.md) and
`report_digest` (the seed-determined lines nbval compares), from the report dict that
`experiments.comparison_report` makes (its figure is `viz.plots.plot_comparison`)."""
from __future__ import annotations

from typing import Any

from arpo_lib.evaluation.stats import holm, train_quarter
from arpo_lib.run.registry import COMPARISON_ARMS

ARM_LABELS = {"grpo": "GRPO", "arpo": "ARPO", "arpo_tis": "ARPO+TIS", "arpo_seeded": "ARPO seeded",
              "arpo_served": "ARPO served", "arpo_async1": "ARPO async, staleness 1",
              "arpo_async1_plain": "ARPO async s1, uncorrected"}
"""How the tables name an arm (`compare.algos`); an arm not named here shows its own name."""

PAIRED_LABELS = {"eval": "final eval success", "train": "train success, last quarter",
                 "final_t": "final policy at T=train", "transfer": "fresh layouts (transfer)"}
"""How the paired table names each of `evaluation.stats.PAIRED_MEASURES`."""

PREREGISTERED = {"primary": "arpo-grpo", "secondary": ("arpo_tis-arpo", "arpo_seeded-arpo"), "measure": "final_t",
                 "alpha": 0.05}
"""The held-out comparison as docs/learning.md (section 8, "Pre-registration") fixed it before any
held-out run: ARPO − GRPO on the final policy at the training temperature, paired by seed, exact
permutation test at 5%; ARPO+TIS − ARPO and ARPO seeded − ARPO secondary, Holm-corrected."""

REGIME_ALL_FAILED, REGIME_INJECTIONS = 0.25, 10
"""When replay has something to do (the bar of docs/learning.md, section 8): in an arm with replay,
at least this share of groups all-failed in the first half of training, and at least this many
injections per run."""


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
    lines += _preregistered_lines(report)
    lines += _transfer_lines(report)
    if report.get("paired"):
        lines += ["", "Paired differences (same seed: same first batch, task order and evaluation episodes); "
                  "the last column: seeds a paired test (5%, power 0.8) would need for a true 5-point difference, "
                  "given the spread of these differences:", "",
                  "| comparison | measure | mean difference [95% CI] | seeds a > b / a < b / equal | p (permutation) | "
                  "p (sign) | seeds for 5 pts |",
                  "|---|---|---|---|---|---|---|"]
        for name, measures in report["paired"].items():
            a, b = name.split("-")
            for measure, d in measures.items():
                diffs = d["differences"]
                wins, losses = sum(x > 0 for x in diffs), sum(x < 0 for x in diffs)
                lines.append(f"| {ARM_LABELS.get(a, a)} − {ARM_LABELS.get(b, b)} | {PAIRED_LABELS[measure]} | "
                             f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | "
                             f"{wins} / {losses} / {len(diffs) - wins - losses} | "
                             f"{d['p_permutation']:.3f} | {d['p_sign']:.3f} | {d.get('seeds_for_5_points') or '–'} |")
    lines += _regime_lines(report)
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


def _preregistered_lines(report: dict[str, Any]) -> list[str]:
    """The pre-registered result (`PREREGISTERED`), in a report of the pre-registered study
    (`compare.preregistered`) that has its primary comparison on its measure: the verdict the plan
    fixed, and the secondary comparisons with Holm's adjustment. A partial report says its verdict
    is provisional."""
    paired, measure, alpha = report.get("paired") or {}, PREREGISTERED["measure"], PREREGISTERED["alpha"]
    primary = paired.get(PREREGISTERED["primary"], {}).get(measure)
    if primary is None or not report.get("preregistered"):
        return []

    def label(name: str) -> str:
        return " − ".join(ARM_LABELS.get(arm, arm) for arm in name.split("-"))

    def stated(d: dict[str, Any]) -> str:
        return (f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] over {len(d['differences'])} seeds, "
                f"p (permutation) {d['p_permutation']:.3f}, p (sign) {d['p_sign']:.3f}, "
                f"seeds for 5 pts {d.get('seeds_for_5_points') or '–'}")

    beats = primary["p_permutation"] < alpha and primary["mean"] > 0
    verdict = " beats ".join(label(PREREGISTERED["primary"]).split(" − ")) if beats else "no detectable difference"
    lines = ["", f"Pre-registered comparison (docs/learning.md, section 8; {PAIRED_LABELS[measure]}, paired by seed):", "",
             f"- primary, {label(PREREGISTERED['primary'])}: {stated(primary)} -> **{verdict}** at {alpha:.0%}"]
    secondary = [(n, paired[n][measure]) for n in PREREGISTERED["secondary"] if measure in paired.get(n, {})]
    for (name, d), adjusted in zip(secondary, holm([d["p_permutation"] for _, d in secondary])):
        lines.append(f"- secondary, {label(name)}: {stated(d)}; Holm-adjusted p {adjusted:.3f} -> "
                     f"{'different' if adjusted < alpha else 'no detectable difference'}")
    if report.get("missing_runs"):
        lines.append(f"- **provisional**: {len(report['missing_runs'])} run(s) of the plan not finished")
    return lines


def _transfer_lines(report: dict[str, Any]) -> list[str]:
    """Success on fresh layouts of the trained tasks: the warm start's and each arm's."""
    warm = report.get("warm_start_transfer")
    if not warm:
        return []
    lines = ["", f"Transfer: success on fresh layouts of the trained tasks ({', '.join(warm['tasks'])}; "
             f"{warm['episodes']} episodes per model at the training temperature, the same for every model): "
             f"warm start **{warm['success_rate']:.3f}**.", "",
             "| arm | seeds | fresh-layout success | gain over warm start |", "|---|---|---|---|"]
    for algo, a in report["arms"].items():
        t, g = a.get("transfer_success"), a.get("transfer_gain_over_warm_start")
        if t and g:
            lines.append(f"| {ARM_LABELS.get(algo, algo)} | {t['n']} | {t['mean']:.3f} [{t['lo']:.3f}, {t['hi']:.3f}] | "
                         f"{g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] |")
    return lines


def _regime_lines(report: dict[str, Any]) -> list[str]:
    """Did replay have something to do? Per arm the all-failed share in the first half and the
    injections per run against the bar; per step (mean over seeds) all-failed share, injections
    and the age of what was injected."""
    arms = {a: v["regime"] for a, v in report["arms"].items() if v.get("regime")}
    if not arms:
        return []
    with_replay = {a: COMPARISON_ARMS.get(a, {}).get("algo.replay.enabled", True) for a in arms}
    lines = ["", f"Regime: replay can only act on all-failed groups. The bar: at least {REGIME_ALL_FAILED:.0%} of groups "
             f"all-failed in the first half of training and at least {REGIME_INJECTIONS} injections per run "
             "(in an arm with replay).", "",
             "| arm | all-failed share, first half [95% CI] | injections per run [95% CI] | range | meets the bar |",
             "|---|---|---|---|---|"]
    for algo, r in arms.items():
        af, inj = r["all_failed_first_half"], r["injections_per_run"]
        replay = with_replay[algo]
        meets = af["mean"] >= REGIME_ALL_FAILED and (not replay or inj["mean"] >= REGIME_INJECTIONS)
        lines.append(f"| {ARM_LABELS.get(algo, algo)} | {af['mean']:.2f} [{af['lo']:.2f}, {af['hi']:.2f}] | "
                     f"{inj['mean']:.1f} [{inj['lo']:.1f}, {inj['hi']:.1f}] | {inj['min']:.0f}-{inj['max']:.0f} | "
                     f"{'yes' if meets else 'no'}{'' if replay else ' (no replay: all-failed share only)'} |")
    steps = min(len(r["per_step"]["all_failed_groups"]) for r in arms.values())
    # columns per arm: all-failed share; with replay, injections; where recorded, their age
    cols = {a: ["all-failed"] + (["inj."] if with_replay[a] else []) +
            (["age"] if with_replay[a] and "replay_age_mean" in r["per_step"] else []) for a, r in arms.items()}
    head = " | ".join(f"{ARM_LABELS.get(a, a)} {' | '.join(c)}" for a, c in cols.items())
    lines += ["", "Per step, mean over seeds" + (" (age: policy versions between a replayed trajectory and the policy "
              "it trained)" if any("age" in c for c in cols.values()) else "") + ":", "", f"| step | {head} |",
              "|---|" + "|".join("|".join("---" for _ in c) for c in cols.values()) + "|"]
    for i in range(steps):
        cells = []
        for algo, r in arms.items():
            p = r["per_step"]
            cells.append(f"{p['all_failed_groups'][i]:.2f}")
            if "inj." in cols[algo]:
                cells.append(f"{p['replay_injections'][i]:.2f}")
            if "age" in cols[algo]:
                age = p["replay_age_mean"][i]
                cells.append("–" if age is None else f"{age:.1f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def report_digest(report: dict[str, Any]) -> str:
    """The seed-determined numbers of a comparison, rounded (what nbval compares)."""
    rows = [f"warm start eval {report['warm_start_eval']['success_rate']:.3f}, tasks kept {len(report['tasks'])}"]
    for r in report["runs"]:
        rows.append(f"{r['algo']}-s{r['seed']}: eval {r['eval']['success_rate']:.3f}, "
                    f"injections {sum(r['replay_injections'])}")
    return "\n".join(rows)
