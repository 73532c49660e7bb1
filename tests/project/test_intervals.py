"""benchmarks/intervals.py: paired gaps over seeds and their 95 % t-intervals.

Oracles: intervals computed by hand from tiny fixed per-seed values (t_{0.975,2} = 4.3027,
t_{0.975,1} = 12.7062 from a t table), and scipy's t quantiles.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import intervals


def test_paired_gap_of_three_seeds_by_hand() -> None:
    # d = (0.1, 0.2, 0.3): mean 0.2, sd 0.1, half = 4.3027 * 0.1 / sqrt(3) = 0.248417
    arm = {0: 2.1, 1: 2.2, 2: 2.3, 7: 9.9}  # seed 7 has no fp32 run: not paired
    fp32 = {0: 2.0, 1: 2.0, 2: 2.0}
    gap = intervals.paired_gap(arm, fp32)
    assert gap.n == 3
    assert gap.mean == pytest.approx(0.2)
    assert gap.sd == pytest.approx(0.1)
    assert gap.half == pytest.approx(0.248417, abs=1e-6)
    assert (gap.low, gap.high) == (pytest.approx(-0.048417, abs=1e-6), pytest.approx(0.448417, abs=1e-6))
    # relative: 5, 10, 15 %: mean 10, sd 5, half = 4.3027 * 5 / sqrt(3) = 12.42083
    relative = intervals.paired_gap(arm, fp32, relative=True)
    assert relative.mean == pytest.approx(10.0)
    assert relative.half == pytest.approx(12.42083, abs=1e-4)


def test_pairing_is_by_seed_not_by_means() -> None:
    # arm and fp32 have the same mean (2.1) but arm is 0.01 above fp32 in every seed: the paired
    # interval (sd 0) is the point +0.01; an unpaired comparison would see nothing
    arm = {0: 2.01, 1: 2.11, 2: 2.21}
    fp32 = {0: 2.00, 1: 2.10, 2: 2.20}
    gap = intervals.paired_gap(arm, fp32)
    assert gap.mean == pytest.approx(0.01)
    assert gap.half == pytest.approx(0.0, abs=1e-12)


def test_two_seeds_and_one_seed() -> None:
    # d = (0.1, 0.3): mean 0.2, sd sqrt(0.02) = 0.141421, half = 12.7062 * 0.141421 / sqrt(2) = 1.27062
    gap = intervals.paired_gap({0: 1.1, 1: 1.3}, {0: 1.0, 1: 1.0})
    assert gap.sd == pytest.approx(math.sqrt(0.02))
    assert gap.half == pytest.approx(1.27062, abs=1e-5)
    single = intervals.paired_gap({0: 1.1}, {0: 1.0})
    assert single.n == 1 and single.half is None and single.low is None


def test_t_quantiles_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df, value in intervals.T975.items():
        assert value == pytest.approx(stats.t.ppf(0.975, df), abs=1e-4)


def test_bounds_are_the_interval_and_one_value_its_own() -> None:
    # 1, 2, 3: mean 2, sd 1, half = 4.3027 / sqrt(3) = 2.48417
    mean, low, high = intervals.bounds([1.0, 2.0, 3.0])
    assert (mean, low, high) == (
        pytest.approx(2.0),
        pytest.approx(-0.48417, abs=1e-5),
        pytest.approx(4.48417, abs=1e-5),
    )
    assert intervals.bounds([5.0]) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="no values"):
        intervals.bounds([])
