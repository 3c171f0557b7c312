"""Bootstrap intervals, paired tests and the measures of a comparison's runs, on hand-computed cases."""
from __future__ import annotations

import pytest

from arpo_lib.evaluation.stats import (band, bootstrap_ci, describe, final_gain, holm, moving, paired_comparison,
                                      paired_permutation_test, quarter_by_task, quarter_mean, regime, seeds_needed,
                                      sign_test, train_gain, train_quarter)


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_agreement():
    spread = bootstrap_ci([0.1, 0.5, 0.2, 0.9, 0.4, 0.3, 0.6, 0.0])
    assert spread["lo"] < spread["mean"] < spread["hi"] and spread["mean"] == pytest.approx(0.375)
    tight = bootstrap_ci([0.5, 0.5, 0.5, 0.5])
    assert tight == {"mean": 0.5, "lo": 0.5, "hi": 0.5, "n": 4}
    assert bootstrap_ci([0.1, 0.5, 0.2, 0.9], seed=3) == bootstrap_ci([0.1, 0.5, 0.2, 0.9], seed=3)
    assert bootstrap_ci([0.7]) == {"mean": 0.7, "lo": 0.7, "hi": 0.7, "n": 1}


def test_exact_permutation_test_on_small_cases():
    # 3 pairs, all differences +1: only the all-plus and all-minus patterns reach |sum| = 3.
    assert paired_permutation_test([1, 1, 1], [0, 0, 0]) == pytest.approx(2 / 8)
    # differences (1, -1): every pattern gives |sum| 0 or 2; the observed 0 is matched by all four.
    assert paired_permutation_test([1, 0], [0, 1]) == 1.0
    # 8 pairs all +0.2: p = 2 / 256
    assert paired_permutation_test([0.5] * 8, [0.3] * 8) == pytest.approx(2 / 256)
    # differences (3, 1, 1): |sum| >= 5 for (+,+,+) and (-,-,-) only -> 2/8
    assert paired_permutation_test([3, 1, 1], [0, 0, 0]) == pytest.approx(0.25)


def test_monte_carlo_beyond_the_exact_limit_is_close_to_exact():
    a = [0.3 + 0.01 * i for i in range(20)]
    b = [0.25 + 0.012 * i for i in range(20)]
    p = paired_permutation_test(a, b, resamples=20_000, seed=1)
    assert 0 < p < 1 and p == paired_permutation_test(a, b, resamples=20_000, seed=1)


def test_sign_test():
    assert sign_test([1] * 8, [0] * 8) == pytest.approx(2 / 256)
    assert sign_test([1, 0, 1, 0], [0, 1, 0, 1]) == 1.0
    assert sign_test([0.5, 0.5], [0.5, 0.5]) == 1.0


def test_holm_adjusts_step_down_in_the_given_order():
    # sorted 0.01, 0.03, 0.04 -> x3, x2, x1 = 0.03, 0.06, 0.04 -> monotone 0.03, 0.06, 0.06
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert holm([0.6, 0.02]) == pytest.approx([0.6, 0.04])
    assert holm([0.7, 0.9]) == pytest.approx([1.0, 1.0])  # 1.4 capped at 1; 0.9 raised to it (monotone)
    assert holm([0.2]) == [0.2] and holm([]) == []


def test_errors_and_bands():
    with pytest.raises(ValueError):
        paired_permutation_test([1, 2], [1])
    with pytest.raises(ValueError):
        bootstrap_ci([])
    rows = band([[0.0, 0.5, 1.0], [0.2, 0.5, 0.8]])
    assert [r["mean"] for r in rows] == pytest.approx([0.1, 0.5, 0.9])
    assert rows[1]["lo"] == rows[1]["hi"] == 0.5


def test_describe_and_moving_average():
    d = describe([0.25, 0.75])
    assert (d["mean"], d["min"], d["max"], d["n"], d["lo"], d["hi"]) == (0.5, 0.25, 0.75, 2, 0.25, 0.75)
    assert d["std"] == pytest.approx(0.3535534, rel=1e-6)  # Bessel's correction
    assert describe([0.4])["std"] == 0.0
    assert moving([0.0, 0.3, 0.6, 0.9]) == pytest.approx([0.0, 0.15, 0.3, 0.6])  # trailing window of 3


def _record(algo, seed, final, by_task=None, final_t=None):
    return {"algo": algo, "seed": seed, "eval": {"success_rate": final}, "train_success": [0.0, 0.2, 0.4, 0.6, 0.8],
            "train_success_by_task": by_task or [], "final_train_t": final_t}


def test_quarters_weigh_tasks_equally_and_fall_back_to_the_raw_curve():
    assert quarter_mean([0.0, 0.2, 0.4, 0.6, 0.8], last=True) == 0.8  # 5 // 4 = 1 step
    assert quarter_mean([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0], last=False) == pytest.approx(0.1)
    # the last quarter (1 of 4 steps) drew "a" 9 times (all solved) and "b" once (failed)
    steps = [{"a": [0, 2], "b": [0, 2]}] * 3 + [{"a": [9, 9], "b": [0, 1]}]
    run = _record("arpo", 0, 0.5, by_task=steps)
    assert quarter_by_task(run, last=True) == {"a": 1.0, "b": 0.0}
    assert train_quarter(run, last=True) == 0.5  # not 9 / 10
    assert train_quarter(_record("arpo", 0, 0.5), last=False) == 0.0  # no per-task numbers: the raw rate
    warm = {"success_rate": 0.3, "tasks": [{"task": "a", "success_rate": 0.5}, {"task": "b", "success_rate": 0.1}]}
    assert train_gain(run, warm) == pytest.approx(((1.0 - 0.5) + (0.0 - 0.1)) / 2)
    assert train_gain(_record("arpo", 0, 0.5), warm) == pytest.approx(0.8 - 0.3)
    assert final_gain(run, warm) is None
    final_t = {"success_rate": 0.6, "by_task": {"a": 0.9, "b": 0.3}}
    assert final_gain(_record("arpo", 0, 0.5, final_t=final_t), warm) == pytest.approx((0.4 + 0.2) / 2)


def test_paired_comparison_measures_only_what_both_arms_have():
    final_t = {"success_rate": 0.5, "by_task": {}}
    runs = [_record("arpo", 0, 0.5, final_t=final_t), _record("grpo", 0, 0.25, final_t=final_t),
            _record("arpo", 1, 0.75, final_t=final_t), _record("grpo", 1, 0.25)]
    both = paired_comparison(runs, "arpo", "grpo", [0, 1])
    assert set(both) == {"eval", "train"}  # grpo-s1 has no final policy at the training temperature
    assert both["eval"]["differences"] == [0.25, 0.5] and both["eval"]["p_sign"] == 0.5
    assert both["train"]["differences"] == [0.0, 0.0] and both["train"]["p_permutation"] == 1.0
    assert set(paired_comparison(runs, "arpo", "grpo", [0])) == {"eval", "train", "final_t"}


def test_paired_comparison_has_transfer_and_a_seed_count_for_5_points():
    def rec(algo, seed, final, fresh):
        return {**_record(algo, seed, final), "transfer": {"success_rate": fresh}}

    runs = [rec("arpo", 0, 0.5, 0.3), rec("grpo", 0, 0.5, 0.2), rec("arpo", 1, 0.5, 0.4), rec("grpo", 1, 0.5, 0.2)]
    both = paired_comparison(runs, "arpo", "grpo", [0, 1])
    assert both["transfer"]["differences"] == pytest.approx([0.1, 0.2])
    # std of the differences 0.0707: ((1.96 + 0.8416) * 0.0707 / 0.05)^2 = 15.7 -> 16, + 1
    assert both["transfer"]["seeds_for_5_points"] == 17
    assert both["eval"]["seeds_for_5_points"] is None  # no spread: nothing to say


def test_seeds_needed_follows_the_normal_approximation():
    assert seeds_needed(0.1, 0.05) == 33  # (2.8016 * 2)^2 = 31.4 -> 32, + 1
    assert seeds_needed(0.1, 0.1) == 9 and seeds_needed(0.2, 0.05) > seeds_needed(0.1, 0.05)
    assert seeds_needed(0.1, 0.05, power=0.9) > seeds_needed(0.1, 0.05)
    assert seeds_needed(0.0, 0.05) is None and seeds_needed(0.001, 0.5) == 2
    with pytest.raises(ValueError, match="difference"):
        seeds_needed(0.1, 0.0)


def test_regime_per_step_and_first_half():
    runs = [{"all_failed_groups": [1.0, 0.5, 0.5, 0.0], "replay_injections": [0, 2, 1, 0],
             "replay_age_by_step": [None, 3.0, 5.0, None]},
            {"all_failed_groups": [0.5, 0.5, 0.0, 0.0], "replay_injections": [1, 1, 0, 0],
             "replay_age_by_step": [1.0, 2.0, None, None]}]
    r = regime(runs)
    assert r["per_step"]["all_failed_groups"] == [0.75, 0.5, 0.25, 0.0]
    assert r["per_step"]["replay_injections"] == [0.5, 1.5, 0.5, 0.0]
    assert r["per_step"]["replay_age_mean"] == [1.0, 2.5, 5.0, None]  # over the seeds that injected
    assert r["all_failed_first_half"]["mean"] == pytest.approx(0.625)  # (0.75 + 0.5) / 2
    assert r["injections_per_run"]["mean"] == 2.5 and r["injections_per_run"]["max"] == 3
    old = [{k: v for k, v in run.items() if k != "replay_age_by_step"} for run in runs]  # recorded before ages per step
    assert "replay_age_mean" not in regime(old)["per_step"]
