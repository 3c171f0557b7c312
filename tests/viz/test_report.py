"""The comparison's report as text: the committed learning reports are made again, byte for byte,
from the runs they hold (the statistics and the rendering must not drift under a refactor)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo_lib.run.config import load_config

DOCS = Path(__file__).resolve().parents[2] / "docs"

# docs/learning-fixed-instances is not among them: it was made before the report had per-seed gains
# (`gains_by_seed`) and the paired table's "a > b / a < b / equal" column, so today's code makes a
# longer report from its runs.
REPORTS = ["learning-fresh-10steps", "learning-fresh-12steps", "learning-fresh-seeds", "learning-mixed"]


def remade(report: dict) -> dict:
    """`report` made again by `experiments.comparison_report` from its runs, its warm start's
    evaluations and the setting it records."""
    from arpo_lib.experiments import comparison_report

    experiment, ev = Path(report["experiment"]), report["eval"]
    base = load_config("configs/learning_miniwob.yaml")
    cfg = load_config("configs/learning_miniwob.yaml", [
        f"out_dir={experiment.parent}", f"name={experiment.name}",
        f"compare.algos={json.dumps(list(report['arms']))}",
        f"compare.seeds={json.dumps(sorted({r['seed'] for r in report['runs']}))}",
        f"train.steps={report['steps']}", f"train.tasks_per_batch={report['rollouts_per_step'] // base.rollout.group_size}",
        f"eval.samples_per_task={ev['samples_per_task']}", f"eval.temperature={ev['temperature']}",
        f"eval.seed={ev['seed']}", f"eval.protocol={ev['protocol']}", f"rollout.temperature={ev['train_temperature']}"])
    warm_train = dict(report["warm_start_train_temperature"],
                      tasks=[{"task": t, "success_rate": s} for t, s in report["warm_start_train_by_task"].items()])
    again = comparison_report(cfg, dict(report["warm_start_eval"]), report["runs"], report["tasks"],
                              warm_train=warm_train)
    return {**again, "missing_runs": report["missing_runs"],
            "seconds_total_this_call": report["seconds_total_this_call"]}


@pytest.mark.parametrize("name", REPORTS)
def test_a_committed_report_is_made_again_byte_for_byte(name):
    from arpo_lib.viz.report import report_markdown

    committed = (DOCS / name / "report.json").read_text()
    again = remade(json.loads(committed))
    assert json.dumps(again, indent=1) == committed
    assert report_markdown(again) == (DOCS / name / "report.md").read_text()


def test_the_digest_and_the_partial_report():
    from arpo_lib.viz.report import report_digest, report_markdown

    report = json.loads((DOCS / "learning-mixed" / "report.json").read_text())
    digest = report_digest(report).splitlines()
    assert digest[0] == f"warm start eval 0.133, tasks kept {len(report['tasks'])}"
    assert len(digest) == 1 + len(report["runs"]) and digest[1].startswith("grpo-s0: eval ")
    partial = report_markdown({**report, "missing_runs": ["arpo-s7", "grpo-s7"]}).splitlines()
    assert partial[2] == ("**Partial report: 2 run(s) not finished** (arpo-s7, grpo-s7); "
                          "the figures cover the finished ones only.")


def test_the_notebook_reaches_the_report_through_experiments():
    from arpo_lib import experiments
    from arpo_lib.viz import report

    assert experiments.report_markdown is report.report_markdown
    assert experiments.report_digest is report.report_digest


def test_the_preregistered_verdict_and_holm_on_the_secondaries():
    """The block docs/learning.md's pre-registration fixed: the primary verdict (ARPO − GRPO on the
    final policy at T=train, p < 0.05 and positive), the secondaries Holm-adjusted, provisional
    while runs are missing; absent from a report without the primary measure."""
    from arpo_lib.viz.report import _preregistered_lines

    def diff(mean, p):
        return {"mean": mean, "lo": mean - 0.02, "hi": mean + 0.02, "differences": [mean] * 8,
                "p_permutation": p, "p_sign": p, "seeds_for_5_points": 12}

    paired = {"arpo-grpo": {"final_t": diff(0.06, 0.0078)}, "arpo_tis-arpo": {"final_t": diff(0.01, 0.04)},
              "arpo_seeded-arpo": {"final_t": diff(0.05, 0.02)}}
    assert _preregistered_lines({"paired": paired}) == []  # not the pre-registered study (exploratory seeds)
    text = "\n".join(_preregistered_lines({"paired": paired, "preregistered": True}))
    assert "ARPO − GRPO: +0.060 [+0.040, +0.080] over 8 seeds, p (permutation) 0.008" in text
    assert "**ARPO beats GRPO** at 5%" in text
    assert "ARPO+TIS − ARPO" in text and "Holm-adjusted p 0.040 -> different" in text  # 2 x 0.02, then max
    assert "ARPO seeded − ARPO" in text and "provisional" not in text
    assert text.count("Holm-adjusted p 0.040") == 2  # 0.04 stays 0.04 (monotone over 0.04)
    negative = {**paired, "arpo-grpo": {"final_t": diff(-0.06, 0.0078)}}
    assert "**no detectable difference**" in "\n".join(_preregistered_lines({"paired": negative, "preregistered": True}))
    unsure = {**paired, "arpo-grpo": {"final_t": diff(0.06, 0.2)}}
    lines = _preregistered_lines({"paired": unsure, "missing_runs": ["grpo-s107"], "preregistered": True})
    assert "**no detectable difference**" in lines[3] and "**provisional**: 1 run(s)" in lines[-1]
    assert _preregistered_lines({"paired": {"arpo-grpo": {"eval": diff(0.1, 0.01)}}, "preregistered": True}) == []
