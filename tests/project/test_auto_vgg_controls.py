"""benchmarks/auto/vgg_controls.py: steps to the target, late accuracy and its paired difference.

Oracle: tiny synthetic runs written as ``evals.jsonl`` files, each answer worked out by hand in
the comments (the first evaluation at or past the target, the mean of the evaluations from
step 100 on, the per-seed difference from ``none`` in points with Student's t at n = 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "auto"))
import vgg_controls


def _write(folder: Path, curve: list[tuple[int, float]]) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": step, "accuracy": accuracy, "loss": 1.0}) for step, accuracy in curve]
    (folder / "evals.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(
        json.dumps({"bytes_sent_per_step": 4.0, "bytes_received_per_step": 12.0})
    )


def test_the_summary_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    curves = {  # per arm, per seed: evaluations at steps 50, 100, 150
        "none": {0: [(50, 0.80), (100, 0.84), (150, 0.86)], 1: [(50, 0.81), (100, 0.85), (150, 0.85)]},
        "bf16": {0: [(50, 0.80), (100, 0.84), (150, 0.86)], 1: [(50, 0.81), (100, 0.85), (150, 0.85)]},
        "sidco-exp": {0: [(50, 0.82), (100, 0.86), (150, 0.88)], 1: [(50, 0.83), (100, 0.87), (150, 0.89)]},
        "alone": {0: [(50, 0.70), (100, 0.74), (150, 0.76)], 1: [(50, 0.71), (100, 0.73), (150, 0.75)]},
    }
    for arm, seeds in curves.items():
        for seed, curve in seeds.items():
            _write(tmp_path / f"{arm}-s{seed}", curve)
    monkeypatch.setattr(vgg_controls, "goal", lambda workload: 0.855)
    monkeypatch.setattr(vgg_controls, "candidate_run", lambda arm, seed: tmp_path / f"{arm}-s{seed}")
    summary = vgg_controls.summarize(["alone"], [0, 1], tmp_path)
    arms = summary["arms"]
    # none: seed 0 first reaches 0.855 at step 150 (0.86), seed 1 never (0.85 < 0.855)
    assert [arms["none"][s]["steps_to_target"] for s in (0, 1)] == [150, None]
    # sidco-exp: 0.86 at step 100 and 0.87 at step 100; alone never
    assert [arms["sidco-exp"][s]["steps_to_target"] for s in (0, 1)] == [100, 100]
    assert [arms["alone"][s]["steps_to_target"] for s in (0, 1)] == [None, None]
    # late mean (steps 100 and 150): none 0.85 and 0.85; sidco-exp 0.87 and 0.88
    assert arms["none"][0]["late_mean_accuracy"] == pytest.approx(0.85)
    assert arms["sidco-exp"][1]["late_mean_accuracy"] == pytest.approx(0.88)
    # sidco-exp - none per seed: +2 and +3 points; mean 2.5, sd 0.7071, t(1) 12.7062:
    # half width 12.7062 * 0.7071 / sqrt(2) = 6.353
    versus = summary["late_points_vs_none"]["sidco-exp"]
    assert versus["mean"] == pytest.approx(2.5)
    assert (versus["low"], versus["high"]) == (
        pytest.approx(2.5 - 6.353, abs=1e-3),
        pytest.approx(2.5 + 6.353, abs=1e-3),
    )
    # bf16 equals none on both seeds: a zero-width interval at 0
    assert summary["late_points_vs_none"]["bf16"] == pytest.approx({"mean": 0.0, "low": 0.0, "high": 0.0})
    assert "none" not in summary["late_points_vs_none"]
    # the bytes are each run's summary's, as written
    assert (arms["alone"][1]["bytes_sent_per_step"], arms["alone"][1]["bytes_received_per_step"]) == (
        4.0,
        12.0,
    )


def test_the_committed_summary_is_what_its_runs_say() -> None:
    """results/auto/vgg_controls.json against its committed runs, read here directly."""
    committed = json.loads((vgg_controls.ROOT / "results" / "auto" / "vgg_controls.json").read_text())
    for arm in vgg_controls.CONTROLS:
        for seed in committed["seeds"]:
            lines = (vgg_controls.RUNS / f"{arm}-s{seed}" / "evals.jsonl").read_text().splitlines()
            late = [json.loads(line)["accuracy"] for line in lines if json.loads(line)["step"] >= 100]
            entry = committed["arms"][arm][str(seed)]
            assert entry["late_mean_accuracy"] == pytest.approx(sum(late) / len(late))
