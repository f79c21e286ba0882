"""Confidence intervals for the accuracy report (scipy's, wrapped so every table uses the same methods).

* accuracy of one cell (k correct of n): Wilson score interval (``scipy.stats.binomtest(...).proportion_ci``);
* means of per-sample values (KL divergence, a task average of accuracies): percentile bootstrap over samples
  (``scipy.stats.bootstrap``, fixed seed); a task average resamples each task's samples separately (stratified);
* a paired difference (two modes on the same samples): percentile bootstrap of the mean per-sample difference.
"""
from __future__ import annotations

import numpy as np

CONFIDENCE = 0.95
N_RESAMPLES = 2000


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion; (nan, nan) for n = 0."""
    if n <= 0:
        return float("nan"), float("nan")
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def _boot(data: tuple[np.ndarray, ...], statistic, seed: int, confidence: float) -> tuple[float, float]:
    from scipy.stats import bootstrap

    if all(np.ptp(d) == 0 for d in data):  # constant samples: the interval is the point
        v = float(statistic(*data, axis=-1))
        return v, v
    res = bootstrap(data, statistic, n_resamples=N_RESAMPLES, confidence_level=confidence, method="percentile",
                    vectorized=True, random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def bootstrap_mean(values, seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-sample values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size == 1:
        return float(x[0]), float(x[0])
    return _boot((x,), lambda a, axis: np.mean(a, axis=axis), seed, confidence)


def paired_difference(a, b, seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Mean of a - b over paired samples and its percentile bootstrap interval."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same shape, got {a.shape} and {b.shape}")
    d = a - b
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = bootstrap_mean(d, seed, confidence)
    return float(d.mean()), lo, hi


def stratified_mean(groups, seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Mean over groups of each group's mean (e.g. the task average of accuracies) and a stratified bootstrap
    interval: each group's samples are resampled on their own, so every resample keeps all groups."""
    gs = [np.asarray(g, dtype=np.float64) for g in groups if len(g)]
    if not gs:
        return float("nan"), float("nan"), float("nan")
    point = float(np.mean([g.mean() for g in gs]))
    if all(g.size == 1 for g in gs):
        return point, point, point

    def stat(*xs, axis):
        return np.mean([np.mean(x, axis=axis) for x in xs], axis=0)
    lo, hi = _boot(tuple(gs), stat, seed, confidence)
    return point, lo, hi


def verdict(lo: float, hi: float) -> str:
    """How a difference's interval reads: 'higher', 'lower' or 'no significant difference'."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "n/a"
    if lo > 0:
        return "higher"
    if hi < 0:
        return "lower"
    return "no significant difference"


__all__ = ["CONFIDENCE", "wilson", "bootstrap_mean", "paired_difference", "stratified_mean", "verdict"]
