"""benchmarks/memory/peak.py: the bytes each method is expected to keep, against a hand count.

Oracle: a Linear(3, 2) (8 parameters) counted by hand from docs/memory.md's rule. The
measured table is checked against its JSON by tests/project/test_claims.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "memory"))
import peak

ARMS = {arm.label: arm for arm in peak.ARMS}


@pytest.mark.parametrize(
    ("label", "optimizer", "kept", "peak_bytes"),
    [
        ("stock", "sgd", 0, 0),
        ("none", "adamw", 0, 0),
        (
            "bf16",
            "sgd",
            8 * 2,
            8 * (2 + 2),
        ),  # the mean kept with its allreduce's handle, the payload in flight
        (
            "topk",
            "sgd",
            8 * (4 + 4 - 4),
            8 * (4 + 4 - 4) + 8 * 4,
        ),  # SGD's momentum buffer moves into the hook; the compensated gradient of the (one) bucket
        ("topk", "adamw", 8 * 12, 8 * 12 + 8 * 4),  # + the preconditioner; the compensated gradient too
        ("sidco-exp", "adamw", 8 * (4 + 4 + 4), 8 * 12 + 8 * 4),  # residual, velocity, preconditioner
        (
            "efsignsgd",
            "adamw",
            8 * 12,
            8 * 12 + 8 * 4,
        ),  # the compensated gradient of the (one) bucket, its velocity waiting in the bucket
        ("powersgd", "sgd", 8 * 4, 8 * 4 + 8 * 4),  # c, made the new residual in place
        ("powersgd", "adamw", 8 * 4, 8 * 4 + 8 * 4),  # AdamW keeps its moments, as stock AdamW does
        ("diloco", "sgd", 8 * (4 + 4 - 4), 8 * 4 + 8 * 8),  # model copy + residual, no DDP bucket
    ],
)
def test_expected_bytes_equal_the_hand_count(label: str, optimizer: str, kept: int, peak_bytes: int) -> None:
    expected = peak.expected_bytes(ARMS[label], optimizer, torch.nn.Linear(3, 2))
    assert expected == {"kept": kept, "peak": peak_bytes}


def test_the_sparsifiers_step_holds_the_largest_buckets_compensated_gradient() -> None:
    linear = torch.nn.Linear(3, 2)  # 8 parameters, say in buckets of 6 and 2
    assert peak.expected_bytes(ARMS["sidco-exp"], "sgd", linear, largest_bucket=6) == {
        "kept": 8 * 4,
        "peak": 8 * 4 + 6 * 4,
    }
    assert peak.expected_bytes(ARMS["sidco-exp"], "adamw", linear, largest_bucket=6)["peak"] == 8 * 12 + 6 * 4


def test_frozen_parameters_keep_nothing() -> None:
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    assert peak.expected_bytes(ARMS["topk"], "sgd", model) == {"kept": 6 * 4, "peak": 6 * 8}


def test_every_arm_runs_under_stock_ddp_first() -> None:
    assert peak.ARMS[0].method is None
    assert all(opt in peak.ARMS[0].optimizers for arm in peak.ARMS for opt in arm.optimizers)


def test_the_threshold_cost_pairs_each_round_and_counts_the_rss_over_stock() -> None:
    """benchmarks/memory/threshold_cost.py's summary, against numbers worked out by hand: two
    rounds, the step times and peak RSS growths of three arms under the three settings."""
    import threshold_cost

    step = {("glibc defaults", 0): 100.0, ("threshold fixed", 0): 150.0, ("threshold fixed, huge pages", 0): 120.0,
            ("glibc defaults", 1): 200.0, ("threshold fixed", 1): 250.0, ("threshold fixed, huge pages", 1): 220.0}  # fmt: skip
    rss = {"stock": 1000, "topk": 1800, "sidco-exp": 1400}
    runs = [
        {"round": n, "setting": setting, "arm": arm, "step_ms": step[(setting, n)] * (2 if arm == "topk" else 1),
         "extra_rss": rss[arm] - (200 if setting != "glibc defaults" and arm != "stock" else 0)}
        for n in (0, 1) for setting in threshold_cost.SETTINGS for arm in threshold_cost.ARMS
    ]  # fmt: skip
    arms = threshold_cost.summarise(runs, parameter_bytes=400)
    topk = arms["topk"]
    assert topk["glibc defaults"] == {
        "step_ms": 300.0,
        "extra_rss_over_parameter_bytes": 2.0,
    }  # (1800 - 1000) / 400
    assert topk["threshold fixed"] == {
        "step_ms": 400.0,
        "extra_rss_over_parameter_bytes": 1.5,
    }  # (1600 - 1000) / 400
    assert topk["threshold fixed, huge pages"] == {
        "step_ms": 340.0,  # the median of 240 and 440
        "extra_rss_over_parameter_bytes": 1.5,
    }
    assert topk["step_over_defaults"]["threshold fixed, huge pages"]["per_round"] == [1.2, 1.1]
    ratio = topk["step_over_defaults"]["threshold fixed"]
    assert ratio["per_round"] == [1.5, 1.25]
    # mean 1.375, stdev 0.1767767, t(0.975, 1 df) 12.7062: half-width 12.7062 * 0.1767767 / sqrt(2) = 1.588275
    assert ratio["mean"] == pytest.approx(1.375)
    assert (ratio["low"], ratio["high"]) == (
        pytest.approx(1.375 - 1.588275, abs=1e-5),
        pytest.approx(1.375 + 1.588275, abs=1e-5),
    )
    assert arms["stock"]["threshold fixed"]["extra_rss_over_parameter_bytes"] == 0.0
