"""95 % bootstrap intervals over prompts: of a mean, of a pooled ratio (sum over sum), of a paired
ratio of two runs over the same prompts, with the interval for a sample that does not vary. numpy only
(no model, runner or task code): the benchmarks, the summary tables, the reports and the notebooks take
their intervals from here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

UNIT = (0.0, 1.0)  # shares: exact matches with the greedy output, answer agreement


def resamples(n: int, n_resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """(n_resamples, n) indices of bootstrap resamples of n items; equal for equal (n, seed), so two
    statistics over the same items (a paired comparison) can share them."""
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def _interval(statistics: np.ndarray) -> tuple[float, float]:
    """2.5th and 97.5th percentiles, resamples where the statistic is undefined (nan) left out."""
    statistics = statistics[np.isfinite(statistics)]
    if len(statistics) == 0:
        return float("nan"), float("nan")
    return float(np.percentile(statistics, 2.5)), float(np.percentile(statistics, 97.5))


def bootstrap_ci(values: Sequence[float], n_resamples: int = 2000, seed: int = 0,
                 bounds: tuple[float, float] | None = None) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of the finite ``values`` (nan items, e.g. the NLL of
    an empty output, are left out before resampling: take the estimate over the same items).

    ``bounds``: the range (lo, hi) every value lies in (a 0-1 score, a share, their differences). Where all
    the values are equal the bootstrap has no spread, and its zero-width interval would claim a precision
    the prompts do not give (five prompts that all agree say little about the sixth): the interval is then
    :func:`constant_sample_interval` instead."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    if bounds is not None and values.min() == values.max():
        return constant_sample_interval(float(values[0]), len(values), bounds)
    return _interval(values[resamples(len(values), n_resamples, seed)].mean(axis=1))


def constant_sample_interval(value: float, n: int, bounds: tuple[float, float]) -> tuple[float, float]:
    """95 % interval of the mean of a quantity in ``bounds`` = (lo, hi) when all ``n`` sampled prompts gave
    ``value``. None of n prompts lies off ``value``, so the share of prompts that would is at most
    r = 1 - 0.025^(1/n) (Clopper-Pearson, one-sided 97.5 %: 0.52 at n = 5, 0.12 at n = 30), and the mean
    lies in [value - r (value - lo), value + r (hi - value)]."""
    lo, hi = bounds
    r = 1.0 - 0.025 ** (1.0 / n)
    return value - r * (value - lo), value + r * (hi - value)


def difference_bounds(bounds: tuple[float, float], scale: float = 1.0) -> tuple[float, float]:
    """The range of ``scale * (a - b)`` for a and b in ``bounds`` (a change of a bounded score or share)."""
    spread = scale * (bounds[1] - bounds[0])
    return -spread, spread


def _pooled(num: np.ndarray, den: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """sum(num) / sum(den) over each resample's items (nan where the denominator sums to 0)."""
    n, d = num[idx].sum(axis=-1), den[idx].sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1), np.nan)


def pooled_ratio_ci(num: Sequence[float], den: Sequence[float], n_resamples: int = 2000,
                    seed: int = 0, bounds: tuple[float, float] | None = None) -> tuple[float, float]:
    """95 % bootstrap interval of the pooled ratio sum(num) / sum(den) (e.g. tau: tokens over target
    calls), item i contributing num[i] and den[i].

    ``bounds``: the range (lo, hi) of the ratio (a share: (0, 1)). Where every item with den > 0 gives the
    same num / den (one prompt holds all the accepted mismatches, or no accepted mismatch lies outside the
    top 5) the resampled ratios have no spread, and the interval is :func:`constant_sample_interval` over those items, as
    :func:`bootstrap_ci` does for equal values (prompts weighted alike)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(num) == 0:
        return float("nan"), float("nan")
    contributing = den > 0
    if bounds is not None and contributing.any():
        ratios = num[contributing] / den[contributing]
        if ratios.min() == ratios.max():
            return constant_sample_interval(float(ratios[0]), int(contributing.sum()), bounds)
    return _interval(_pooled(num, den, resamples(len(num), n_resamples, seed)))


def paired_ratio_ci(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float], den_b: Sequence[float],
                    n_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of (sum(num_a) / sum(den_a)) / (sum(num_b) / sum(den_b)) where item i
    is one prompt decoded by runs a and b: each resample takes the same prompts for both."""
    arrays = [np.asarray(x, dtype=float) for x in (num_a, den_a, num_b, den_b)]
    if len(arrays[0]) == 0:
        return float("nan"), float("nan")
    idx = resamples(len(arrays[0]), n_resamples, seed)
    a, b = _pooled(arrays[0], arrays[1], idx), _pooled(arrays[2], arrays[3], idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _interval(a / b)
