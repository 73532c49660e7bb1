"""benchmarks/convergence/analyze44.py: issue 44's paired gaps, their 95 % t-intervals and the bytes factor.

Oracles: intervals computed by hand from tiny fixed per-seed losses (t_{0.975,2} = 4.3027,
t_{0.975,1} = 12.7062 from a t table), and the ring allreduce's 2 (W - 1) / W written out.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "convergence"))
import analyze44
import campaign44


def test_paired_gap_of_three_seeds_by_hand() -> None:
    # d = (0.1, 0.2, 0.3): mean 0.2, sd 0.1, half = 4.3027 * 0.1 / sqrt(3) = 0.248417
    arm = {0: 2.1, 1: 2.2, 2: 2.3, 7: 9.9}  # seed 7 has no fp32 run: not paired
    fp32 = {0: 2.0, 1: 2.0, 2: 2.0}
    gap = analyze44.paired_gap(arm, fp32)
    assert gap.n == 3
    assert gap.mean == pytest.approx(0.2)
    assert gap.sd == pytest.approx(0.1)
    assert gap.half == pytest.approx(0.248417, abs=1e-6)
    assert (gap.low, gap.high) == (pytest.approx(-0.048417, abs=1e-6), pytest.approx(0.448417, abs=1e-6))
    # relative: 5, 10, 15 %: mean 10, sd 5, half = 4.3027 * 5 / sqrt(3) = 12.42083
    relative = analyze44.paired_gap(arm, fp32, relative=True)
    assert relative.mean == pytest.approx(10.0)
    assert relative.half == pytest.approx(12.42083, abs=1e-4)


def test_pairing_is_by_seed_not_by_means() -> None:
    # arm and fp32 have the same mean (2.1) but arm is 0.01 above fp32 in every seed: the paired
    # interval (sd 0) is the point +0.01; an unpaired comparison would see nothing
    arm = {0: 2.01, 1: 2.11, 2: 2.21}
    fp32 = {0: 2.00, 1: 2.10, 2: 2.20}
    gap = analyze44.paired_gap(arm, fp32)
    assert gap.mean == pytest.approx(0.01)
    assert gap.half == pytest.approx(0.0, abs=1e-12)


def test_two_seeds_and_one_seed() -> None:
    # d = (0.1, 0.3): mean 0.2, sd sqrt(0.02) = 0.141421, half = 12.7062 * 0.141421 / sqrt(2) = 1.27062
    gap = analyze44.paired_gap({0: 1.1, 1: 1.3}, {0: 1.0, 1: 1.0})
    assert gap.sd == pytest.approx(math.sqrt(0.02))
    assert gap.half == pytest.approx(1.27062, abs=1e-5)
    single = analyze44.paired_gap({0: 1.1}, {0: 1.0})
    assert single.n == 1 and single.half is None and single.low is None
    assert "no interval" in analyze44.ci_text(single, 3)
    assert analyze44.ci_text(gap, 3) == "+0.200 [-1.071, +1.471]"


def test_t_quantiles_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df, value in analyze44.T975.items():
        assert value == pytest.approx(stats.t.ppf(0.975, df), abs=1e-4)


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
