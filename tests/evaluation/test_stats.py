"""Bootstrap intervals and paired tests on hand-computed cases."""
from __future__ import annotations

import pytest

from arpo_lib.evaluation.stats import band, bootstrap_ci, paired_permutation_test, sign_test


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


def test_errors_and_bands():
    with pytest.raises(ValueError):
        paired_permutation_test([1, 2], [1])
    with pytest.raises(ValueError):
        bootstrap_ci([])
    rows = band([[0.0, 0.5, 1.0], [0.2, 0.5, 0.8]])
    assert [r["mean"] for r in rows] == pytest.approx([0.1, 0.5, 0.9])
    assert rows[1]["lo"] == rows[1]["hi"] == 0.5
