"""Statistics for comparing training arms over seeds: bootstrap intervals and paired tests.

Pure functions on plain lists (no torch, no I/O), seeded so that a report is reproducible.

- `bootstrap_ci(values)`: the mean and a percentile bootstrap 95% interval of the mean over
  seeds (resampling seeds with replacement).
- `paired_permutation_test(a, b)`: the two-sided p-value of "arm a and arm b have the same mean",
  pairing run i of a with run i of b (same seed: same first batch, task order, evaluation seeds).
  Under the null each paired difference is as likely positive as negative, so the test flips
  signs: exactly over all 2^n sign patterns up to 16 pairs, by seeded Monte Carlo beyond.
- `sign_test(a, b)`: the exact two-sided sign test, a cruder companion.
"""
from __future__ import annotations

import itertools
import math
import random
import statistics
from typing import Sequence

EXACT_LIMIT = 16
"""Up to this many pairs the permutation test enumerates every sign pattern (65,536)."""


def bootstrap_ci(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000,
                 seed: int = 0) -> dict[str, float]:
    """{mean, lo, hi, n}: the mean of `values` and its percentile bootstrap interval."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("bootstrap_ci needs at least one value")
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(statistics.fmean(rng.choices(xs, k=n)) for _ in range(resamples))
    alpha = (1.0 - confidence) / 2
    lo = means[max(0, math.floor(alpha * resamples))]
    hi = means[min(resamples - 1, math.ceil((1.0 - alpha) * resamples) - 1)]
    return {"mean": mean, "lo": lo, "hi": hi, "n": n}


def paired_permutation_test(a: Sequence[float], b: Sequence[float], *, resamples: int = 100_000,
                            seed: int = 0) -> float:
    """Two-sided p-value for mean(a - b) = 0, pairs (a[i], b[i]) from the same seed."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty lists of paired values, got {len(a)} and {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    observed = abs(sum(diffs))
    tolerance = 1e-12 * max(1.0, observed)
    if len(diffs) <= EXACT_LIMIT:
        patterns = itertools.product((1.0, -1.0), repeat=len(diffs))
        extreme = total = 0
        for signs in patterns:
            total += 1
            extreme += abs(sum(s * d for s, d in zip(signs, diffs))) >= observed - tolerance
        return extreme / total
    rng = random.Random(seed)
    extreme = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed - tolerance
                  for _ in range(resamples))
    return (extreme + 1) / (resamples + 1)  # the observed pattern counts once: never exactly 0


def sign_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Exact two-sided sign test on the paired differences (ties dropped); 1.0 when all tie."""
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def band(curves: Sequence[Sequence[float]], *, confidence: float = 0.95, resamples: int = 2_000,
         seed: int = 0) -> list[dict[str, float]]:
    """Per position of equally long curves (one per seed): the bootstrap interval of the mean."""
    if not curves:
        return []
    length = min(len(c) for c in curves)
    return [bootstrap_ci([c[i] for c in curves], confidence=confidence, resamples=resamples, seed=seed + i)
            for i in range(length)]
