"""benchmarks/convergence/analyze44.py: issue 44's paired gaps in text, and the bytes factor.

Oracles: an interval worked by hand (t_{0.975,1} = 12.7062 from a t table), and the ring
allreduce's 2 (W - 1) / W written out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "convergence"))
import analyze44
import campaign44
import intervals


def test_one_seed_has_no_interval_in_the_text() -> None:
    single = intervals.paired_gap({0: 1.1}, {0: 1.0})
    assert "no interval" in analyze44.ci_text(single, 3)
    # d = (0.1, 0.3): mean 0.2, half = 12.7062 * 0.141421 / sqrt(2) = 1.27062
    assert (
        analyze44.ci_text(intervals.paired_gap({0: 1.1, 1: 1.3}, {0: 1.0, 1: 1.0}), 3)
        == "+0.200 [-1.071, +1.471]"
    )


def test_ring_allreduce_received_bytes() -> None:
    assert analyze44.ring_received(1_915_904, 2) == 1_915_904  # 2 (W - 1) / W = 1 at W = 2
    assert analyze44.ring_received(1_000, 4) == 1_500  # 1.5 at W = 4


def _run(seed: int, loss: float, received: float, workers: int = 2) -> dict:
    return {"seed": seed, "workers": workers, "final_val_loss": loss, "train_loss_last_10pct": loss - 0.1,
            "bytes_sent_per_step": received, "bytes_received_per_step": received,
            "dense_bytes_per_step": 1_000_000.0}  # fmt: skip


def test_table_pairs_with_fp32_and_divides_received_bytes() -> None:
    arms = {
        "none": {s: _run(s, 2.0, 1_000_000.0) for s in (0, 1, 2)},
        "dense-fv": {
            0: _run(0, 2.1, 2_000_000.0),
            1: _run(1, 2.2, 2_000_000.0),
            2: _run(2, 2.3, 2_000_000.0),
        },
        "onebit-adam": {s: _run(s, 2.0, 125_000.0) for s in (0, 1)},
        "alone": {0: _run(0, 2.5, 1_000_000.0, workers=1)},
    }
    text, numbers = analyze44.table("gpt-adamw", arms)
    assert "received" in text.splitlines()[0] and "2(W-1)/W" in text.splitlines()[0]
    assert numbers["dense-fv"]["factor_received"] == pytest.approx(0.5)
    assert numbers["onebit-adam"]["factor_received"] == pytest.approx(8.0)
    assert numbers["dense-fv"]["gap"]["half"] == pytest.approx(0.248417, abs=1e-6)
    assert numbers["onebit-adam"]["gap"]["n"] == 2
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(("| arm", "| ---"))
    ]
    assert [r.split(" | ")[0] for r in rows] == ["| none", "| alone", "| dense-fv", "| onebit-adam"]
    assert "+0.200 [-0.048, +0.448]" in text and "no communication" in text
    assert all("|  |" not in row for row in rows)  # no empty cells


def test_plan_puts_the_controls_first() -> None:
    runs = campaign44.plan(Path("/nonexistent"))
    assert [(r.workload, r.method) for r in runs[:3]] == [
        ("gpt-adamw", "dense-fv"), ("gpt-adamw", "fp32-lr1.5e-3"), ("gpt-adamw", "fp32-lr6e-3")]  # fmt: skip
    assert [r.method for r in runs if r.workload == "gpt-adamw-3k"] == ["dense-fv"] * 3 + [
        "fp32-lr1.5e-3"
    ] * 3
    assert len(campaign44.plan(Path("/nonexistent"), extended=True)) == len(runs) + 3
    dense = campaign44.Run("gpt-adamw", "dense-fv", 0).arguments()
    assert dense[dense.index("--compressor") + 1] == "topk"
    assert "ratio=1.0" in dense and "momentum_masking=false" in dense
    fast = campaign44.Run("gpt-adamw", "fp32-lr6e-3", 1).arguments()
    assert fast[len(fast) - 1 - fast[::-1].index("--lr") + 1] == "0.006"  # the last --lr wins


def test_the_two_effects_are_paired_differences_of_the_controls() -> None:
    # optimizer: dense-fv - fp32 = (-0.1, -0.2, -0.3); compression: onebit - dense-fv = (0.1, 0.1, 0.1)
    arms = {
        "none": {s: _run(s, 2.0, 1_000_000.0) for s in (0, 1, 2)},
        "dense-fv": {s: _run(s, 2.0 - 0.1 * (s + 1), 2_000_000.0) for s in (0, 1, 2)},
        "onebit-adam": {s: _run(s, 2.0 - 0.1 * s, 125_000.0) for s in (0, 1, 2)},
    }
    effects = analyze44.split(arms)
    assert set(effects) == {"optimizer", "compression"}  # no server arm: no third line
    assert effects["optimizer"][1].mean == pytest.approx(-0.2)
    assert effects["optimizer"][1].half == pytest.approx(0.248417, abs=1e-6)
    assert effects["compression"][1].mean == pytest.approx(0.1)
    assert effects["compression"][1].half == pytest.approx(0.0, abs=1e-12)
    text, numbers = analyze44.table("gpt-adamw", arms)
    assert numbers["decomposition"]["optimizer"]["n"] == 3 and "the compression's effect" in text


def _fake_run(directory: Path, seed: int, loss: float, sent: float, received: float) -> None:
    import gzip
    import json

    directory.mkdir(parents=True)
    summary = {"seed": seed, "workers": 2, "final_test_loss": loss, "dense_bytes_per_step": 1_000_000.0}
    (directory / "summary.json").write_text(json.dumps(summary))
    with gzip.open(directory / "steps.jsonl.gz", "wt") as handle:
        for _ in range(10):
            handle.write(json.dumps({"loss": loss, "bytes_sent": sent, "bytes_received": received}) + "\n")


def test_the_root_floors_effect_is_paired_per_seed_with_the_root_as_it_was(tmp_path: Path) -> None:
    """benchmarks/convergence/root_floor.py: the floor - the root as it was (none), seed by seed
    (d = -0.1, -0.3: mean -0.2, sd 0.141421, half = 12.7062 * 0.141421 / sqrt(2) = 1.27062), and the
    bytes factor against the ring allreduce's received bytes (2 (2 - 1) / 2 * 1 MB / 0.125 MB = 8x)."""
    import root_floor

    for seed, (on, off) in enumerate(((1.3, 1.4), (1.2, 1.5))):
        _fake_run(root_floor.run_directory(tmp_path, "onebit", "floor", seed), seed, on, 125_000.0, 125_000.0)
        _fake_run(root_floor.run_directory(tmp_path, "onebit", "none", seed), seed, off, 125_000.0, 125_000.0)
    text, report = root_floor.analyse(tmp_path)
    effect = report["versus_none"]["onebit-floor"]
    assert (effect["n"], effect["mean"]) == (2, pytest.approx(-0.2))
    assert effect["half"] == pytest.approx(1.27062, abs=1e-5)
    assert report["arms"]["onebit-floor"]["factor_received"] == pytest.approx(8.0)
    assert "densefv" not in str(report["arms"])  # no runs, no row
    assert text.count("\n| the 1-bit Adam method (efsignsgd") == 2  # the GPT table's rows: one per side run
