"""benchmarks/convergence/lengths.py: each AdamW gap at each run length, and its slope per doubling.

Oracles: the gap written out by hand from the finals, and numpy's least-squares line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "convergence"))
import lengths


def _section(steps: int, fp32: float, methods: dict[str, tuple[float, float | None, int]]) -> dict:
    return {
        "steps": steps,
        "fp32_final_mean": fp32,
        "methods": {
            m: {"final_mean": mean, "final_sd": sd, "seeds": list(range(n))}
            for m, (mean, sd, n) in methods.items()
        },
    }


def test_gaps_and_slopes_per_worker_count() -> None:
    analysis = {
        "workloads": {
            "gpt-adamw": _section(
                314, 2.0, {"none": (2.0, 0.1, 3), "a": (2.2, 0.04, 3), "b": (2.1, None, 1)}
            ),
            "gpt-adamw-1k": _section(1000, 1.6, {"none": (1.6, 0.1, 3), "a": (1.68, 0.016, 3)}),
            "gpt-adamw-3k": _section(
                3000, 1.3, {"none": (1.3, 0.1, 3), "a": (1.313, 0.013, 2), "b": (1.404, 0.0, 3)}
            ),
            "gpt-adamw-w4": _section(314, 2.1, {"none": (2.1, 0.1, 3), "a": (2.31, 0.1, 3)}),
            "gpt-adamw-w4-3k": _section(3000, 1.2, {"none": (1.2, 0.1, 3), "c": (1.176, 0.012, 1)}),
        }
    }
    out = lengths.gaps_by_length(analysis)
    assert set(out) == {"2", "4"}
    four = out["4"]
    assert four["steps"] == [314, 3000]
    assert np.allclose(four["methods"]["a"]["gaps"][0], 10.0) and four["methods"]["a"]["gaps"][1] is None
    assert four["methods"]["a"]["slope_per_doubling"] is None  # one length: no slope
    assert np.allclose(four["methods"]["c"]["gaps"][1], -2.0)
    series = out["2"]
    assert series["steps"] == [314, 1000, 3000]
    a, b = series["methods"]["a"], series["methods"]["b"]
    assert np.allclose(a["gaps"], [10.0, 5.0, 1.0])
    assert np.allclose(a["sds"], [2.0, 1.0, 1.0])
    assert a["seeds"] == [3, 3, 2]
    x = np.log2([314, 1000, 3000])
    assert np.isclose(a["slope_per_doubling"], np.polyfit(x, [10.0, 5.0, 1.0], 1)[0])
    assert b["gaps"][1] is None and b["sds"][0] is None
    assert np.isclose(b["slope_per_doubling"], (8.0 - 5.0) / (x[2] - x[0]))
    text = lengths.markdown(out)
    assert "| a | +10.0 ± 2.0 % (3) | +5.0 ± 1.0 % (3) | +1.0 ± 1.0 % (2) |" in text
    assert "| b | +5.0 % (1) | - | +8.0 ± 0.0 % (3) | +0.9 |" in text
    assert "| c | - | -2.0 ± 1.0 % (1) | - |" in text
