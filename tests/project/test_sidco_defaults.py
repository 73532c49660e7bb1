"""SIDCo's ``exact_below`` defaults follow the committed crossover measurement.

Oracle: ``results/compress/crossover-cpu.json`` (``benchmarks/compress/crossover.py``, one
thread, CPU time) names, per variant, the smallest size at which the statistical path
costs less than the exact top-k; the default is that size rounded up to a power of two,
as docs/sidco.md states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gradsift

CROSSOVER = Path(__file__).resolve().parents[2] / "results" / "compress" / "crossover-cpu.json"
MEASURED = json.loads(CROSSOVER.read_text())["crossover"]


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_exact_below_is_the_measured_crossover_rounded_up_to_a_power_of_two(name: str) -> None:
    measured = MEASURED[name]
    default = gradsift.get_compressor(name, ratio=0.01).options()["exact_below"]
    power_of_two = default & (default - 1) == 0
    assert power_of_two and default // 2 < measured <= default, (name, measured, default)
