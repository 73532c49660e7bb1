"""Paired differences over seeds: the mean and its 95 % Student's t-interval.

For values ``d_1 .. d_n`` (one per seed, each an arm's result less its baseline's of the same
seed) the interval is ``mean(d) +- t_{0.975, n-1} sd(d) / sqrt(n)``, ``sd`` with ``n - 1``.
One value gives no interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: t_{0.975, df}: the two-sided 95 % quantile of Student's t (scipy's values to 4 decimals).
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646, 8: 2.3060,
        9: 2.2622, 10: 2.2281, 11: 2.2010, 12: 2.1788, 13: 2.1604, 14: 2.1448, 15: 2.1314, 16: 2.1199,
        17: 2.1098, 18: 2.1009, 19: 2.0930, 20: 2.0860, 25: 2.0595, 30: 2.0423}  # fmt: skip


def t975(df: int) -> float:
    """``t_{0.975, df}``: :data:`T975`, scipy beyond it."""
    if df < 1:
        raise ValueError("a t-interval needs two paired values or more")
    if df in T975:
        return T975[df]
    from scipy.stats import t  # beyond the table

    return float(t.ppf(0.975, df))


@dataclass(frozen=True)
class Interval:
    """``mean +- half`` over ``n`` paired values (``half`` None when n = 1)."""

    n: int
    mean: float
    sd: float | None
    half: float | None

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half


def interval(values: list[float]) -> Interval:
    """The 95 % t-interval of the mean of ``values``."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(1, mean, None, None)
    sd = statistics.stdev(values)
    return Interval(n, mean, sd, t975(n - 1) * sd / math.sqrt(n))


def bounds(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)`` of :func:`interval`; one value is its own bounds."""
    found = interval(values)
    if found.half is None:
        return found.mean, found.mean, found.mean
    return found.mean, found.mean - found.half, found.mean + found.half


def paired_gap(arm: dict[int, float], reference: dict[int, float], relative: bool = False) -> Interval:
    """The paired gap ``arm - reference`` over the seeds both have (``relative``: in % of the
    reference's value of the same seed)."""
    seeds = sorted(set(arm) & set(reference))
    if relative:
        return interval([100.0 * (arm[s] / reference[s] - 1.0) for s in seeds])
    return interval([arm[s] - reference[s] for s in seeds])
