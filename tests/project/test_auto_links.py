"""benchmarks/auto/links.py's repeats: the median run of an arm, and auto over the fastest.

Oracle: three hand-made repeats whose medians and settled medians are worked out in the
comments (the median of three is the middle one; the settled ratio is auto's median of its
settled medians over the least fixed arm's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "auto"))
import links


def _run(median: float, settled: float, choice: str | None = None) -> dict:
    return {
        "step_time_median_s": median,
        "settled_median_s": settled,
        "auto": None if choice is None else {"choice": choice},
    }


def test_the_median_repeat_is_kept_and_auto_is_compared_over_whole_and_settled_steps() -> None:
    repeats = [
        {"none": _run(0.30, 0.30), "bf16": _run(0.12, 0.11), "auto": _run(0.16, 0.12, "bf16")},
        {"none": _run(0.28, 0.27), "bf16": _run(0.10, 0.10), "auto": _run(0.11, 0.10, "bf16")},
        {"none": _run(0.32, 0.31), "bf16": _run(0.14, 0.13), "auto": _run(0.13, 0.11, "none")},
    ]
    row = links.row("1gbit", "vgg", repeats)
    runs, summary = row["runs"], row["summary"]
    # medians per arm: none 0.30 (repeat 0), bf16 0.12 (repeat 0), auto 0.13 (repeat 2, chose none)
    assert runs["bf16"]["step_time_median_s"] == 0.12
    assert runs["bf16"]["repeats_median_s"] == [0.12, 0.10, 0.14]
    assert runs["auto"]["auto"] == {"choice": "none"} and summary["auto_choice"] == "none"
    assert summary["auto_choices"] == ["bf16", "none"] and summary["fastest_fixed"] == "bf16"
    assert summary["auto_over_fastest"] == pytest.approx(0.13 / 0.12)
    assert summary["auto_over_none"] == pytest.approx(0.13 / 0.30)
    # settled: auto median(0.12, 0.10, 0.11) = 0.11; bf16 median(0.11, 0.10, 0.13) = 0.11
    assert summary["settled_auto_over_fastest"] == pytest.approx(1.0)


def test_an_even_count_keeps_the_lower_middle_run() -> None:
    runs = [_run(0.2, 0.2), _run(0.1, 0.1), _run(0.4, 0.4), _run(0.3, 0.3)]
    assert links.median_run(runs)["step_time_median_s"] == 0.2
