"""Statistics for comparing training arms over seeds: bootstrap intervals, paired tests, and the
measures of a comparison's runs.

Pure functions (no torch, no I/O), seeded so that a report is reproducible.

- `bootstrap_ci(values)`: the mean and a percentile bootstrap 95% interval of the mean over
  seeds (resampling seeds with replacement).
- `paired_permutation_test(a, b)`: the two-sided p-value of "arm a and arm b have the same mean",
  pairing run i of a with run i of b (same seed: same first batch, task order, evaluation seeds).
  Under the null each paired difference is as likely positive as negative, so the test flips
  signs: exactly over all 2^n sign patterns up to 16 pairs, by seeded Monte Carlo beyond.
- `sign_test(a, b)`: the exact two-sided sign test, a cruder companion.
- `holm(p_values)`: Holm's step-down adjustment for a family of tests (the secondary comparisons).
- `band(curves)`, `moving(values)`: a curve's interval per step over seeds, and its smoothing.

The rest read the record of one run of a comparison (`experiments.run_arm` writes it to
`<arm>-s<seed>/final.json`): `eval` (its final evaluation's summary), `train_success` and
`train_success_by_task` (per step; the latter {task: [successes, episodes]}), `all_failed_groups`,
`replay_injections`, the importance-weight and replay-age series, and `final_train_t` where the
final policy was also run at the training temperature. A baseline is an evaluation result (its
`success_rate` and per-task `tasks`).

- `train_quarter`, `train_gain`, `final_gain`: a run's training success and its gains over the
  warm start, task by task;
- `arm_statistics(runs, warm, warm_train)`: every measure of one arm over its seeds (`describe`:
  mean, std, range and bootstrap interval);
- `paired_comparison(runs, a, b, seeds)`: arm a minus arm b seed by seed, on each measure of
  `PAIRED_MEASURES` both have, with `seeds_needed`: how many seeds a given difference would need;
- `regime(runs)`: whether replay had something to do (all-failed groups, injections per step).
"""
from __future__ import annotations

import itertools
import math
import random
import statistics
from typing import Any, Sequence

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


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times
    (m - i), made monotone and capped at 1. Reject at level alpha where the adjusted p < alpha:
    the family-wise error rate stays at alpha for any dependence between the tests."""
    ps = [float(p) for p in p_values]
    order = sorted(range(len(ps)), key=ps.__getitem__)
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def band(curves: Sequence[Sequence[float]], *, confidence: float = 0.95, resamples: int = 2_000,
         seed: int = 0) -> list[dict[str, float]]:
    """Per position of equally long curves (one per seed): the bootstrap interval of the mean."""
    if not curves:
        return []
    length = min(len(c) for c in curves)
    return [bootstrap_ci([c[i] for c in curves], confidence=confidence, resamples=resamples, seed=seed + i)
            for i in range(length)]


def moving(values: list[float], window: int = 3) -> list[float]:
    """Trailing moving average (the curves' smoothing)."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def seeds_needed(std: float, difference: float = 0.05, *, alpha: float = 0.05, power: float = 0.8) -> int | None:
    """Seeds (pairs) a two-sided paired test at level `alpha` needs to detect a true mean
    difference `difference` with probability `power`, when paired differences have standard
    deviation `std`: the normal approximation n = ((z_{1-alpha/2} + z_power) * std / difference)^2,
    plus one pair for estimating the std (t rather than z). None when `std` is 0 (no spread
    measured yet: any n, or too few seeds to say)."""
    if difference <= 0:
        raise ValueError(f"difference must be > 0, got {difference}")
    if std <= 0:
        return None
    z = statistics.NormalDist()
    n = ((z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * std / difference) ** 2
    return max(2, math.ceil(n) + 1)


def regime(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Did replay have something to do? Over an arm's runs: per step (mean over seeds) the share
    of all-failed groups, the injections and the mean age (policy versions) of what was injected;
    the share of all-failed groups in the first half of training and the injections per run
    (`describe`d over seeds)."""
    length = min(len(r["all_failed_groups"]) for r in runs)
    per_step = {
        "all_failed_groups": [statistics.fmean(r["all_failed_groups"][i] for r in runs) for i in range(length)],
        "replay_injections": [statistics.fmean(r["replay_injections"][i] for r in runs) for i in range(length)],
    }
    if all(r.get("replay_age_by_step") for r in runs):
        ages = [[r["replay_age_by_step"][i] for r in runs if r["replay_age_by_step"][i] is not None]
                for i in range(length)]
        per_step["replay_age_mean"] = [statistics.fmean(a) if a else None for a in ages]
    half = max(1, length // 2)
    return {"per_step": per_step,
            "all_failed_first_half": describe([statistics.fmean(r["all_failed_groups"][:half]) for r in runs]),
            "injections_per_run": describe([float(sum(r["replay_injections"])) for r in runs])}


def describe(values: list[float], seed: int = 0) -> dict[str, float]:
    """Mean, Bessel std, range and the bootstrap 95% interval of the mean over seeds."""
    ci = bootstrap_ci(values, seed=seed)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values), "lo": ci["lo"], "hi": ci["hi"]}


def quarter_mean(curve: list[float], last: bool) -> float:
    """The mean of a curve's first or last quarter (at least one point)."""
    tail = max(1, len(curve) // 4)
    return statistics.fmean(curve[-tail:] if last else curve[:tail])


def quarter_by_task(run: dict[str, Any], last: bool) -> dict[str, float]:
    """Training-rollout success per task over the first or last quarter of a run's steps
    (successes / episodes of that task in those steps); {} for a run recorded without it."""
    per_step = run.get("train_success_by_task") or []
    if not per_step or not any(per_step):
        return {}
    tail = max(1, len(per_step) // 4)
    counts: dict[str, list[int]] = {}
    for step in (per_step[-tail:] if last else per_step[:tail]):
        for task, (successes, episodes) in step.items():
            c = counts.setdefault(task, [0, 0])
            c[0] += successes
            c[1] += episodes
    return {task: s / n for task, (s, n) in sorted(counts.items()) if n}


def train_quarter(run: dict[str, Any], last: bool) -> float:
    """Training success over a quarter, every task weighted equally (the batches draw a few tasks
    per step, so a quarter's raw rate weighs them by chance); the raw rate for old records."""
    by_task = quarter_by_task(run, last)
    return statistics.fmean(by_task.values()) if by_task else quarter_mean(run["train_success"], last)


def train_gain(run: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Last-quarter training success minus the warm start's at the training temperature, task by
    task, averaged over the tasks the last quarter trained on: a gain that no task mix can fake.
    `baseline`: an evaluation result (its per-task `tasks`); the overall rates when either side
    has no per-task numbers."""
    by_task = quarter_by_task(run, last=True)
    warm = {t["task"]: t["success_rate"] for t in baseline.get("tasks") or []}
    if by_task and all(task in warm for task in by_task):
        return statistics.fmean(rate - warm[task] for task, rate in by_task.items())
    return quarter_mean(run["train_success"], True) - baseline["success_rate"]


def final_gain(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """The final policy's success at the training temperature minus the warm start's, task by
    task (same episodes), averaged over tasks; None for a run measured without it."""
    final = run.get("final_train_t")
    if not final:
        return None
    warm = {t["task"]: t["success_rate"] for t in baseline.get("tasks") or []}
    by_task = final.get("by_task") or {}
    if by_task and all(task in warm for task in by_task):
        return statistics.fmean(rate - warm[task] for task, rate in by_task.items())
    return final["success_rate"] - baseline["success_rate"]


def arm_statistics(runs: list[dict[str, Any]], warm: dict[str, Any], warm_train: dict[str, Any],
                   warm_transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm over its seeds (`runs`: its records in seed order): final evaluation success and its
    gain over the warm start (`warm`: the warm start's evaluation); training-rollout success in the
    first and last quarter and the last quarter's gain over the warm start at the training
    temperature (`warm_train`), seed by seed; the final policy's gain where every run measured it;
    the share of all-failed groups; replay injections; importance weights and replay age where
    they apply; the curves (moving average 3) with their bands; `regime`; and where every run has
    it, success on fresh layouts (`transfer`) and its gain over the warm start's (`warm_transfer`)."""
    gains = [train_gain(r, warm_train) for r in runs]
    arm = {
        "seeds": [r["seed"] for r in runs],
        "eval_success": describe([r["eval"]["success_rate"] for r in runs]),
        "eval_gain_over_warm_start": describe([r["eval"]["success_rate"] - warm["success_rate"] for r in runs]),
        "train_success_last_quarter": describe([train_quarter(r, True) for r in runs]),
        "train_success_first_quarter": describe([train_quarter(r, False) for r in runs]),
        "train_gain_over_warm_start": describe(gains),
        "every_seed_gained_15_points": all(g >= 0.15 for g in gains),
        "gains_by_seed": gains,
        "all_failed_share": describe([statistics.fmean(r["all_failed_groups"]) for r in runs]),
        "replay_injections": describe([float(sum(r["replay_injections"])) for r in runs]),
        "seconds": describe([float(r["seconds"]) for r in runs]),
    }
    finals = [final_gain(r, warm_train) for r in runs]
    if finals and all(f is not None for f in finals):
        arm["final_gain_over_warm_start"] = describe(finals)  # type: ignore[arg-type]
        arm["final_gains_by_seed"] = finals
        arm["every_seed_final_gained_15_points"] = all(f >= 0.15 for f in finals)  # type: ignore[operator]
    by_task = [quarter_by_task(r, True) for r in runs]
    arm["train_last_quarter_by_task"] = {
        task: statistics.fmean(b[task] for b in by_task if task in b)
        for task in sorted({t for b in by_task for t in b})}
    arm["curves"] = {key: band([moving(r[key]) for r in runs]) for key in ("train_success", "all_failed_groups")}
    arm["regime"] = regime(runs)
    if warm_transfer and all(r.get("transfer") for r in runs):
        arm["transfer_success"] = describe([r["transfer"]["success_rate"] for r in runs])
        arm["transfer_gain_over_warm_start"] = describe([r["transfer"]["success_rate"] - warm_transfer["success_rate"]
                                                         for r in runs])
    for key in ("is_weight_mean", "is_capped_share", "replay_age_mean"):
        per_run = [statistics.fmean(r[key]) for r in runs if r.get(key)]
        if per_run:
            arm[key] = describe(per_run)
    return arm


PAIRED_MEASURES = ("eval", "train", "final_t", "transfer")
"""What arms are compared on, seed by seed: final evaluation success (`eval`), last-quarter
training success (`train`), the final policy's success on the training tasks at the training
temperature (`final_t`) and on fresh layouts of those tasks (`transfer`), the last two where
every run of both arms has them."""


def paired_difference(runs: list[dict[str, Any]], a: str, b: str, seeds: list[int], measure: str) -> dict[str, Any]:
    """Per-seed differences a - b of one of `PAIRED_MEASURES`, their mean with a bootstrap
    interval, and two-sided p-values."""
    def value(algo: str, seed: int) -> float:
        r = next(r for r in runs if r["algo"] == algo and r["seed"] == seed)
        if measure == "eval":
            return r["eval"]["success_rate"]
        if measure == "transfer":
            return r["transfer"]["success_rate"]
        return r["final_train_t"]["success_rate"] if measure == "final_t" else train_quarter(r, True)

    xa, xb = [value(a, s) for s in seeds], [value(b, s) for s in seeds]
    diffs = [x - y for x, y in zip(xa, xb)]
    stats = describe(diffs)
    return {"seeds": seeds, "differences": diffs, **stats,
            "p_permutation": paired_permutation_test(xa, xb), "p_sign": sign_test(xa, xb),
            "seeds_for_5_points": seeds_needed(stats["std"], 0.05)}


def paired_comparison(runs: list[dict[str, Any]], a: str, b: str, seeds: list[int]) -> dict[str, dict[str, Any]]:
    """Arm `a` minus arm `b` on the `seeds` both ran: {measure: `paired_difference`} for each of
    `PAIRED_MEASURES` that every one of their runs has."""
    measures = ["eval", "train"]
    both = [r for r in runs if r["algo"] in (a, b) and r["seed"] in seeds]
    measures += [m for m, key in (("final_t", "final_train_t"), ("transfer", "transfer")) if all(r.get(key) for r in both)]
    return {m: paired_difference(runs, a, b, seeds, m) for m in measures}
