"""benchmarks/auto/time_to_target.py: auto's time to the target, composed from curves and step times.

Oracle: tiny synthetic curves and step times, each answer worked out by hand in the comments
(the first evaluation at or past the target, no interpolation; auto's dense steps at stock
DDP's step, its probes at 6 calls per candidate, the chosen candidate's steps after).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "auto"))
import time_to_target as tta


def _runs(step_s: dict[str, float], choice: str, decided_at: int, measured_ms: dict[str, float]) -> dict:
    """A links.json row's ``runs``: each arm's median step, auto's decision."""
    runs = {arm: {"step_time_median_s": s, "auto": None} for arm, s in step_s.items()}
    runs["auto"] = {
        "step_time_median_s": 99.0,  # auto's own 40-step median: not what the composition charges
        "auto": {"choice": choice, "decided_at": decided_at, "measured_ms": measured_ms},
    }
    return runs


def test_one_seed_accuracy_by_hand_old_probe_format() -> None:
    # fp32's final 0.91 -> target 0.905. none: 0.90 at step 20 is short of it (no interpolation
    # towards 0.91 at 30), so step 30; bf16: 0.92 at step 20.
    curves = {
        "none": {0: [(10, 0.5), (20, 0.90), (30, 0.91)]},
        "bf16": {0: [(10, 0.6), (20, 0.92), (30, 0.93)]},
    }
    final, goal = tta.target("vgg", curves["none"])
    assert final == pytest.approx(0.91) and goal == pytest.approx(0.905)
    # probes (old format): message none 100 ms, message bf16 50 + codec bf16 10 -> 6 x 160 ms = 0.96 s
    runs = _runs({"none": 2.0, "bf16": 1.0}, "bf16", 5, {"step": 1.0, "compute": 1.0, "message none": 100.0,
                                                          "message bf16": 50.0, "codec bf16": 10.0})  # fmt: skip
    row = tta.compose("1gbit", "vgg", runs, curves, goal)
    assert row["fixed"]["none"]["steps_to_target"] == [30]
    assert row["fixed"]["none"]["time_to_target_s"] == [pytest.approx(60.0)]  # 30 x 2 s
    assert row["fixed"]["bf16"]["time_to_target_s"] == [pytest.approx(20.0)]  # 20 x 1 s
    assert row["best_fixed"]["per_seed"] == ["bf16"]
    assert row["auto"]["probe_format"] == "message+codec"
    assert row["auto"]["probe_s"] == pytest.approx(0.96)
    # auto: 5 dense x 2 s + 0.96 s + (20 - 5) x 1 s = 25.96 s
    assert row["auto"]["time_to_target_s"] == [pytest.approx(25.96)]
    assert row["auto"]["one_off_s"] == [pytest.approx(5.96)]  # 25.96 - 20 x 1 s
    assert row["auto_over_best_fixed"]["per_seed"] == [pytest.approx(25.96 / 20.0)]
    assert row["auto_over_none"]["mean"] == pytest.approx(25.96 / 60.0)
    assert row["auto_over_best_fixed"]["low"] is None  # one seed: no interval
    assert tta.verdict(row) == {"within_margin_of_best_fixed": False, "not_later_than_none": True}


def test_three_seeds_loss_not_reached_and_t_interval_by_hand() -> None:
    # fp32's finals 2.0, 2.2, 2.4: mean 2.2 -> target 2.222 (loss: at or below).
    curves = {
        "none": {0: [(100, 3.0), (200, 2.0)], 1: [(100, 3.0), (200, 2.2)], 2: [(100, 3.0), (200, 2.4)]},
        "bf16": {0: [(100, 2.0), (200, 1.9)], 1: [(100, 3.0), (200, 2.1)], 2: [(100, 2.9), (200, 2.8)]},
    }
    _, goal = tta.target("gpt-adamw", curves["none"])
    assert goal == pytest.approx(2.222)
    # probes (new format): routes 200 + 50 ms -> 6 x 0.25 s = 1.5 s
    runs = _runs(
        {"none": 0.5, "bf16": 0.25}, "bf16", 10, {"step": 1.0, "route none": 200.0, "route bf16": 50.0}
    )
    row = tta.compose("100mbit", "gpt-adamw", runs, curves, goal)
    assert row["auto"]["probe_format"] == "route"
    assert row["auto"]["probe_s"] == pytest.approx(1.5)
    # none: 200 x 0.5 = 100 s in seeds 0 and 1; seed 2 ends at 2.4, never reached
    assert row["fixed"]["none"]["time_to_target_s"] == [pytest.approx(100.0), pytest.approx(100.0), None]
    # bf16: step 100 (seed 0), 200 (seed 1) -> 25 s, 50 s; seed 2 never
    assert row["fixed"]["bf16"]["time_to_target_s"] == [pytest.approx(25.0), pytest.approx(50.0), None]
    assert row["best_fixed"]["per_seed"] == ["bf16", "bf16", None]
    assert row["best_fixed"]["steps_to_target"] == [100, 200, None]
    assert row["best_fixed"]["mean_s"] == pytest.approx(37.5)
    # auto: seed 0: 10 x 0.5 + 1.5 + 90 x 0.25 = 29 s; seed 1: 5 + 1.5 + 190 x 0.25 = 54 s
    assert row["auto"]["time_to_target_s"] == [pytest.approx(29.0), pytest.approx(54.0), None]
    assert row["auto"]["reached"] == 2
    ratios = row["auto_over_best_fixed"]
    assert ratios["per_seed"] == [pytest.approx(1.16), pytest.approx(1.08), None] and ratios["n"] == 2
    # mean 1.12; sd = 0.08 / sqrt 2; half = t(0.975, 1) 12.7062 x sd / sqrt 2 = 12.7062 x 0.04 = 0.508248
    assert ratios["mean"] == pytest.approx(1.12)
    assert (ratios["low"], ratios["high"]) == (pytest.approx(1.12 - 0.508248), pytest.approx(1.12 + 0.508248))
    # over none: 0.29, 0.54 -> mean 0.415, half 12.7062 x 0.125 = 1.588275
    against_none = row["auto_over_none"]
    assert against_none["mean"] == pytest.approx(0.415)
    assert against_none["high"] == pytest.approx(0.415 + 1.588275)


def test_a_target_before_the_decision_pays_no_probe_and_never_reached_stays_none() -> None:
    # 3 steps, all dense at 2 s: 6 s; the probes come after step 5, not yet run
    assert tta.auto_time(3, 5, 2.0, 100.0, 1.0) == pytest.approx(6.0)
    assert tta.auto_time(5, 5, 2.0, 0.5, 1.0) == pytest.approx(10.5)  # the probes follow step 5
    assert tta.auto_time(None, 5, 2.0, 0.5, 1.0) is None
    assert tta.step_to_target("vgg", [(25, 0.5), (50, 0.6)], 0.7) is None


def test_vgg_curves_are_checked_across_links_and_gzipped_evals_read(tmp_path: Path) -> None:
    evals = [{"step": 25, "accuracy": 0.5, "loss": 1.0}, {"step": 50, "accuracy": 0.8, "loss": 0.5}]
    for arm, other in (("none", evals), ("bf16", [*evals[:1], {**evals[1], "accuracy": 0.81}])):
        for link, rows in (("1gbit", evals), ("100mbit", other)):
            folder = tmp_path / f"{arm}-w4-{link}"
            folder.mkdir()
            text = "".join(json.dumps(e) + "\n" for e in rows)
            if link == "100mbit":
                with gzip.open(folder / "evals.jsonl.gz", "wt") as handle:
                    handle.write(text)
            else:
                (folder / "evals.jsonl").write_text(text)
    seeds = tmp_path / "seeds"
    curves, check = tta.vgg_curves(("none", "bf16"), tmp_path, seeds)
    assert curves["none"] == {0: [(25, 0.5), (50, 0.8)]}
    assert check["same_per_arm"] == {"none": True, "bf16": False}
    assert check["link_independent"] is False
    # seed 1 of both arms and seed 2 of one: seed 1 joins the curves, seed 2 (not every arm) does not
    for name in ("none-s1", "bf16-s1", "none-s2"):
        (seeds / name).mkdir(parents=True)
        (seeds / name / "evals.jsonl").write_text(
            json.dumps({"step": 25, "accuracy": 0.7, "loss": 0.9}) + "\n"
        )
    curves, _ = tta.vgg_curves(("none", "bf16"), tmp_path, seeds)
    assert curves["none"] == {0: [(25, 0.5), (50, 0.8)], 1: [(25, 0.7)]} and sorted(curves["bf16"]) == [0, 1]


def test_the_probes_measured_wall_time_replaces_the_estimate():
    # new runs record the probes' wall time: 500 ms is 0.5 s, whatever the routes' times;
    # older runs: 6 calls x (10 + 30) ms = 0.24 s
    routes = {"route none": 10.0, "route bf16": 30.0}
    assert tta.probe_seconds({**routes, "probing": 500.0}, {"none": 10.0, "bf16": 30.0}) == pytest.approx(0.5)
    assert tta.probe_seconds(routes, {"none": 10.0, "bf16": 30.0}) == pytest.approx(0.24)


def test_a_repeated_row_replaces_the_single_run_of_its_link_and_workload_only():
    # none reaches 0.905 at step 30, bf16 at step 20; the single run has bf16 at 1 s a step,
    # the repeated row at 3 s (slower than none's 2 s x 30 = 60 s: none is the fastest there)
    curves = {
        "none": {0: [(10, 0.5), (20, 0.90), (30, 0.91)]},
        "bf16": {0: [(10, 0.6), (20, 0.92), (30, 0.93)]},
    }
    measured = {"route none": 1.0, "route bf16": 1.0, "probing": 0.0}

    def entry(link: str, bf16_s: float) -> dict:
        return {"summary": {"link": link, "workload": "vgg"},
                "runs": _runs({"none": 2.0, "bf16": bf16_s}, "none", 5, measured)}  # fmt: skip

    links = {"rows": [entry("localhost", 1.0), entry("1gbit", 1.0)]}
    repeated = {"rows": [entry("localhost", 3.0)]}
    rows = tta.analyze_links(links, lambda workload, arms: curves, repeated)
    assert [r["step_times"] for r in rows] == ["repeated", "single"]
    assert rows[0]["best_fixed"]["per_seed"] == ["none"] and rows[1]["best_fixed"]["per_seed"] == ["bf16"]
    assert rows[1]["fixed"]["bf16"]["time_to_target_s"] == [pytest.approx(20.0)]  # 20 x 1 s


def test_the_paid_route_is_not_a_candidates_probe():
    measured = {"route none": 10.0, "route sidco-exp": 30.0, "route sidco-exp paid": 12.0}
    assert tta.probe_ms(measured) == ("route", {"none": 10.0, "sidco-exp": 30.0})


def test_more_seeds_give_their_steps_to_the_composed_target(tmp_path: Path) -> None:
    """Seeds 3 and 4 of two arms (seed 4 of `b` missing: seed 4 is left out for every arm)."""
    for arm, seed, accuracies in (("a", 3, [0.5, 0.9]), ("b", 3, [0.85, 0.86]), ("a", 4, [0.9, 0.9])):
        run = tmp_path / f"{arm}-s{seed}"
        run.mkdir()
        lines = [
            json.dumps({"step": 25 * (i + 1), "accuracy": a, "loss": 1.0}) for i, a in enumerate(accuracies)
        ]
        (run / "evals.jsonl").write_text("\n".join(lines) + "\n")
    checked = tta.more_seeds(("a", "b"), 0.86, seed_runs=tmp_path)
    assert checked == {"seeds": [3], "steps_to_target": {"a": [50], "b": [50]}}
