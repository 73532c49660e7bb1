"""benchmarks/auto/whole.py: a whole run's time to the target, set beside the composed one.

Oracle: hand-made evaluations and compositions, each answer worked out in the comments (the
first evaluation at or past the target, no interpolation; the training time there; measured
over composed, agreeing within 10 %).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "auto"))
import whole


def test_the_time_to_the_target_is_the_training_time_at_the_first_evaluation_past_it() -> None:
    evals = [
        {"step": 25, "accuracy": 0.80, "train_time_s": 4.0},
        {"step": 50, "accuracy": 0.859, "train_time_s": 8.5},  # 0.859 >= 0.8587: here
        {"step": 75, "accuracy": 0.87, "train_time_s": 12.0},
    ]
    assert whole.measured("vgg", evals, 0.8587) == (50, 8.5)
    assert whole.measured("vgg", evals, 0.95) == (None, None)
    losses = [
        {"step": 104, "loss": 2.4, "train_time_s": 9.0},
        {"step": 208, "loss": 2.16, "train_time_s": 18.0},
    ]
    assert whole.measured("gpt-adamw", losses, 2.1656) == (208, 18.0)  # a loss: at or below


@pytest.mark.parametrize(
    ("measured_s", "ratio", "agree"),
    [(21.8, 1.09, True), (22.2, 1.11, False), (17.0, 0.85, False), (None, None, None)],
)
def test_measured_over_composed_agrees_within_ten_percent(measured_s, ratio, agree) -> None:
    composition = {"seeds": [0, 1, 2], "auto": {"choice": "bf16", "time_to_target_s": [20.0, 30.0, None]}}
    row = whole.compare({"time_to_target_s": measured_s}, composition)
    assert row["composed_s"] == 20.0 and row["composed_choice"] == "bf16"  # seed 0's
    assert row["agree"] is agree
    assert row["measured_over_composed"] == (None if ratio is None else pytest.approx(ratio))


def test_a_fixed_candidates_whole_run_is_set_beside_its_own_composed_time() -> None:
    composition = {
        "seeds": [0, 1],
        "auto": {"choice": "sidco-exp", "time_to_target_s": [20.0, 30.0]},
        "fixed": {"sidco-exp": {"time_to_target_s": [19.0, 29.0]}},
    }
    row = whole.compare({"time_to_target_s": 20.9}, composition, "sidco-exp")
    assert row["composed_s"] == 19.0 and row["composed_choice"] == "sidco-exp"
    assert row["measured_over_composed"] == pytest.approx(1.1) and row["agree"] is True
