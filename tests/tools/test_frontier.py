"""The loss-gap-vs-bytes frontier (gradsift/tools/frontier.py), against numbers worked by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gradsift.tools.frontier import FRONTIER_PLOT, frontier_points, group_by_family
from gradsift.tools.report import find_runs, plot_runs


def run(compressor: str, loss: float, sent: float, *, workers: int = 2, every: int | None = None, **options):
    summary = {"compressor": compressor, "workers": workers, "final_test_loss": loss, "final_perplexity": 3.0,
               "bytes_sent_per_step": sent, "options": options}  # fmt: skip
    return SimpleNamespace(summary=summary, config={"sync_every": every})


RUNS = [
    run("none", 2.0, 1000.0),
    run("none", 2.2, 1000.0),  # reference: mean 2.1
    run("topk", 2.31, 100.0, ratio=0.01),
    run("topk", 2.52, 100.0, ratio=0.01),  # gaps +10 %, +20 %
    run("none", 2.205, 100.0, every=10),  # averaging every 10: +5 %
    run("blockquant", 2.1, 14.0, every=10, bits=4),  # 0 %
    run("blockquant", 2.31, 8.0, every=10, bits=2),  # +10 %
    run("none", 2.625, 1000.0, workers=1),  # alone: +25 %, nothing leaves its process
]


def test_each_setting_is_its_seeds_mean_gap_against_the_dense_per_step_runs() -> None:
    points = {p.setting: p for p in frontier_points(RUNS)}
    topk = next(p for p in points.values() if p.family == "every step: topk")
    assert topk.seeds == 2 and topk.bytes_per_step == 100.0
    assert topk.gap_percent == pytest.approx(15.0)
    assert topk.gap_sd_percent == pytest.approx(7.0710678)  # sample sd of 10 and 20
    reference = [p for p in points.values() if p.family == "every step: none"]
    assert len(reference) == 1 and reference[0].gap_percent == pytest.approx(0.0, abs=1e-12)
    averaging = next(p for p in points.values() if p.family == "every H steps: none")
    assert averaging.gap_percent == pytest.approx(5.0)
    alone = next(p for p in points.values() if p.family.startswith("one worker alone"))
    assert alone.gap_percent == pytest.approx(25.0) and alone.bytes_per_step == 0.0


def test_a_family_is_one_curve_in_increasing_bytes() -> None:
    families = group_by_family(frontier_points(RUNS))
    quantized = families["every H steps: blockquant"]
    assert [p.bytes_per_step for p in quantized] == [8.0, 14.0]
    assert [round(p.gap_percent, 6) for p in quantized] == [10.0, 0.0]
    assert set(families) == {
        "every step: none", "every step: topk", "every H steps: none", "every H steps: blockquant",
        "one worker alone (no communication)",
    }  # fmt: skip


def test_demo_is_its_own_family_and_never_the_reference() -> None:
    demo = run("none", 2.31, 50.0)  # DeMo's runs say compressor none: it exchanges by itself
    demo.config["optimizer"] = "demo"
    points = frontier_points([*RUNS, demo])
    reference = next(p for p in points if p.family == "every step: none")
    assert reference.seeds == 2 and reference.gap_percent == pytest.approx(0.0, abs=1e-12)
    point = next(p for p in points if p.family == "every step: DeMo")
    assert point.gap_percent == pytest.approx(10.0) and point.bytes_per_step == 50.0


def test_no_reference_or_nothing_to_compare_gives_no_frontier() -> None:
    assert frontier_points([r for r in RUNS if r.summary["compressor"] != "none"]) == []
    assert frontier_points(RUNS[:2]) == []  # the reference alone
    classifiers = [
        SimpleNamespace(summary={**r.summary, "final_perplexity": None}, config=r.config) for r in RUNS
    ]
    assert frontier_points(classifiers) == []  # image models: accuracy is their metric


def write_run(
    folder: Path, compressor: str, loss: float, sent: float, every: int | None, compressed: bool
) -> None:
    folder.mkdir(parents=True)
    summary = {
        "compressor": compressor, "workers": 2, "final_test_loss": loss, "final_perplexity": 3.0,
        "bytes_sent_per_step": sent,
        "options": {}, "final_test_accuracy": 0.5, "steps": 2, "bandwidth": None, "compression_factor": 1.0,
        "achieved_density": 1.0, "compress_median_s": 0.0, "decompress_median_s": 0.0,
        "communicate_median_s": 0.0, "compute_median_s": 0.01, "step_time_median_s": 0.01,
        "time_to_accuracy_s": None,
    }  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps({"sync_every": every}))
    steps = "".join(json.dumps({"step": s, "bytes_sent": sent, "density": 1.0}) + "\n" for s in (1, 2))
    if compressed:  # as the campaigns keep it
        import gzip

        (folder / "steps.jsonl.gz").write_bytes(gzip.compress(steps.encode()))
    else:
        (folder / "steps.jsonl").write_text(steps)
    (folder / "evals.jsonl").write_text(json.dumps({"step": 2, "accuracy": 0.5, "train_time_s": 0.02}) + "\n")


def test_report_reads_gzipped_steps_and_draws_the_frontier(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "runs" / "fp32", "none", 2.0, 1000.0, None, compressed=False)
    write_run(tmp_path / "runs" / "avg", "none", 2.1, 100.0, 10, compressed=True)
    runs = find_runs([tmp_path / "runs"])
    assert [len(r.steps) for r in runs] == [2, 2]
    written = plot_runs(runs, tmp_path / "report")
    assert tmp_path / "report" / FRONTIER_PLOT in written
    assert (tmp_path / "report" / FRONTIER_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
