"""benchmarks/quantizers/compare.py, benchmarks/vgc/accuracy.py, benchmarks/training/seeds.py: the summaries over seeds.

Oracle: hand-made run summaries, each answer worked out by hand in the comments (medians,
means, the per-seed differences in points with Student's t at n = 3: 4.3027, the times to the
target paired as ratios, a run that never reached the target counting as the latest).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "quantizers"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "vgc"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))
import accuracy as vgc_accuracy
import compare
import seeds as training_seeds

T3 = 4.3027  # Student's t, 95 %, two degrees of freedom


def _quantizer_run(
    accuracy: float, time: float | None, step: float = 0.1, workers: int = 4
) -> dict[str, float | None]:
    return {"workers": workers, "bytes_sent_per_step": 10.0, "bytes_received_per_step": 30.0, "compression_factor": 4.0,
            "step_time_median_s": step, "compress_median_s": 0.001, "communicate_median_s": 0.05,
            "decompress_median_s": 0.002, "final_test_accuracy": accuracy, "time_to_accuracy_s": time}  # fmt: skip


def _write_quantizer_runs(folder: Path, runs: dict[str, list[dict]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for arm, by_seed in runs.items():
        for seed, run in enumerate(by_seed):
            (folder / f"{arm}-s{seed}.json").write_text(json.dumps(run))


def test_the_quantizer_summary_by_hand(tmp_path: Path) -> None:
    runs = {
        "none": [_quantizer_run(0.80, 40.0, 0.12), _quantizer_run(0.82, 30.0, 0.10), _quantizer_run(0.81, 35.0, 0.11)],
        "bf16": [_quantizer_run(0.81, 20.0), _quantizer_run(0.82, 15.0), _quantizer_run(0.80, 35.0)],
        "sidco-exp": [_quantizer_run(0.82, 10.0), _quantizer_run(0.83, None), _quantizer_run(0.84, 5.0)],
        "alone": [_quantizer_run(0.70, None, workers=1), _quantizer_run(0.71, None, workers=1),
                  _quantizer_run(0.72, 50.0, workers=1)],
    }  # fmt: skip
    _write_quantizer_runs(tmp_path, runs)
    arms = compare.summarize(list(runs), [0, 1, 2], tmp_path)["arms"]
    # none's steps 0.12, 0.10, 0.11: median 0.11; times 40, 30, 35: median 35
    assert arms["none"]["step_time_median_s"] == pytest.approx(0.11)
    assert arms["none"]["time_to_accuracy_s"] == pytest.approx(35.0)
    assert "accuracy_points_vs_none" not in arms["none"]
    # sidco-exp: 10, never, 5 -> sorted 5, 10, inf: median 10, two seeds of three reached
    assert arms["sidco-exp"]["time_to_accuracy_s"] == pytest.approx(10.0)
    assert arms["sidco-exp"]["seeds_reaching_target"] == 2
    # against none per seed: +2, +1, +3 points; mean 2, sd 1, half width 4.3027 / sqrt(3)
    half = T3 * 1.0 / math.sqrt(3)
    assert arms["sidco-exp"]["accuracy_points_vs_none"] == pytest.approx(
        {"mean": 2.0, "low": 2.0 - half, "high": 2.0 + half}
    )
    # sooner than none: 40/10 = 4 and 35/5 = 7 where both reached (seed 1 not): mean 5.5,
    # sd 2.1213, half width 12.7062 * 2.1213 / sqrt(2) = 19.06
    sooner = arms["sidco-exp"]["sooner_than"]["none"]
    assert sooner["per_seed"] == [pytest.approx(4.0), None, pytest.approx(7.0)]
    assert (sooner["mean"], sooner["low"], sooner["high"]) == (
        pytest.approx(5.5), pytest.approx(5.5 - 19.06, abs=0.01), pytest.approx(5.5 + 19.06, abs=0.01)
    )  # fmt: skip
    # against bf16: 20/10 = 2, 35/5 = 7
    assert arms["sidco-exp"]["sooner_than"]["bf16"]["per_seed"] == [
        pytest.approx(2.0),
        None,
        pytest.approx(7.0),
    ]
    # alone reached on one seed of three: the median is "not reached"; it sends and receives nothing
    assert arms["alone"]["time_to_accuracy_s"] is None
    assert arms["alone"]["seeds_reaching_target"] == 1
    assert arms["alone"]["bytes_sent_per_step"] == arms["alone"]["bytes_received_per_step"] == 0.0
    assert arms["alone"]["link"] is None and arms["sidco-exp"]["link"] == compare.BANDWIDTH


def test_the_quantizer_commands_keep_the_protocol_and_drop_the_link_for_the_controls(tmp_path: Path) -> None:
    line = compare.command("sidco-exp", 2, 300, tmp_path / "run", tmp_path / "run.json")
    assert line[line.index("--bandwidth") + 1] == "100mbit"
    assert line[line.index("--seed") + 1] == "2" and line[line.index("--ratio") + 1] == "0.01"
    for control in ("alone", "topk-dense"):
        assert "--bandwidth" not in compare.command(control, 0, 300, tmp_path / "run", tmp_path / "run.json")
    alone = compare.command("alone", 0, 300, tmp_path / "run", tmp_path / "run.json")
    assert alone[len(alone) - 1 - alone[::-1].index("--workers") + 1] == "1"  # the last --workers wins


def _vgc_run(accuracy: float, sent: float, step: float) -> dict[str, float]:
    return {"bytes_sent_per_step": sent, "bytes_received_per_step": 3 * sent, "dense_bytes_per_step": 1000.0,
            "achieved_density": sent / 1000.0, "step_time_median_s": step, "final_test_accuracy": accuracy,
            "train_time_s": 1.0, "parameters": 250, "steps": 10}  # fmt: skip


def test_the_vgc_summary_by_hand() -> None:
    runs = {
        "none": {0: _vgc_run(0.90, 1000.0, 0.2), 1: _vgc_run(0.89, 1000.0, 0.3), 2: _vgc_run(0.91, 1000.0, 0.1)},
        "vgc alpha=2": {0: _vgc_run(0.86, 40.0, 0.4), 1: _vgc_run(0.88, 60.0, 0.5), 2: _vgc_run(0.87, 50.0, 0.3)},
        "alone": {0: _vgc_run(0.80, 1000.0, 0.05), 1: _vgc_run(0.81, 1000.0, 0.05), 2: _vgc_run(0.79, 1000.0, 0.05)},
    }  # fmt: skip
    for run in runs["alone"].values():  # what train() does to the one worker's summary
        run["bytes_sent_per_step"] = run["bytes_received_per_step"] = 0.0
    table = vgc_accuracy.summarize(runs)
    # VGC: bytes 40, 60, 50 -> mean 50, 1000 / 50 = 20x fewer; received 3x; steps median 0.4
    vgc = table["vgc alpha=2"]
    assert vgc["bytes_sent_per_step"] == pytest.approx(50.0)
    assert vgc["bytes_received_per_step"] == pytest.approx(150.0)
    assert vgc["fewer_bytes_than_fp32"] == pytest.approx(20.0)
    assert vgc["achieved_density"] == pytest.approx(0.05)
    assert vgc["step_time_median_s"] == pytest.approx(0.4)
    # against fp32 per seed: -4, -1, -4 points; mean -3, sd sqrt(3), half width 4.3027
    assert vgc["points_vs_fp32"] == pytest.approx({"mean": -3.0, "low": -3.0 - T3, "high": -3.0 + T3})
    assert vgc["final_test_accuracy"] == pytest.approx(0.87)
    # fp32 against itself: zero; one worker alone sent nothing: no factor
    assert table["none"]["points_vs_fp32"] == pytest.approx({"mean": 0.0, "low": 0.0, "high": 0.0})
    assert table["alone"]["fewer_bytes_than_fp32"] is None
    assert table["alone"]["points_vs_fp32"]["mean"] == pytest.approx(-10.0)


def _training_run(folder: Path, final: float, curve: list[tuple[float, float]]) -> None:
    """A kept run: its summary and evaluations as (training seconds, accuracy)."""
    folder.mkdir(parents=True)
    summary = {"final_test_accuracy": final, "step_time_median_s": 0.5, "bytes_sent_per_step": 8.0,
               "bytes_received_per_step": 24.0, "compression_factor": 2.0, "workers": 4}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))
    lines = [
        json.dumps({"step": 25 * (i + 1), "accuracy": a, "train_time_s": t}) for i, (t, a) in enumerate(curve)
    ]
    (folder / "evals.jsonl").write_text("\n".join(lines) + "\n")


def test_the_training_summary_by_hand(tmp_path: Path) -> None:
    # seed 0: fp32 ends 0.86 (target 0.85), seed 1: 0.88 (target 0.87)
    _training_run(tmp_path / "none-s0", 0.86, [(10, 0.80), (20, 0.85), (30, 0.86)])
    _training_run(tmp_path / "none-s1", 0.88, [(10, 0.80), (20, 0.86), (40, 0.88)])
    _training_run(tmp_path / "bf16-s0", 0.86, [(5, 0.80), (10, 0.85), (15, 0.86)])
    _training_run(tmp_path / "bf16-s1", 0.87, [(5, 0.80), (10, 0.86), (20, 0.87)])
    _training_run(tmp_path / "sidco-exp-s0", 0.87, [(2, 0.85), (4, 0.86), (6, 0.87)])
    _training_run(tmp_path / "sidco-exp-s1", 0.86, [(2, 0.84), (4, 0.85), (6, 0.86)])
    summary = training_seeds.summarize(["none", "bf16", "sidco-exp"], [0, 1], tmp_path)
    assert summary["targets"] == {0: pytest.approx(0.85), 1: pytest.approx(0.87)}
    arms = summary["arms"]
    # first evaluation at or past the target: fp32 20 and 40 s, bf16 10 and 20 s
    assert arms["none"]["time_to_target_s"] == [20, 40]
    assert arms["bf16"]["time_to_target_s"] == [10, 20]
    # sidco-exp: 2 s on seed 0 (0.85), never on seed 1 (0.86 < 0.87)
    assert arms["sidco-exp"]["time_to_target_s"] == [2, None]
    assert arms["sidco-exp"]["seeds_reaching_target"] == 1
    # sooner than fp32 where both reached: 20 / 2 = 10 (one seed: no interval); bf16 twice as soon
    assert arms["sidco-exp"]["sooner_than"]["none"]["per_seed"] == [pytest.approx(10.0), None]
    assert arms["sidco-exp"]["sooner_than"]["none"]["low"] is None
    assert arms["bf16"]["sooner_than"]["none"]["mean"] == pytest.approx(2.0)
    assert "sooner_than" not in arms["none"] and "points_vs_none" not in arms["none"]
    # accuracy against fp32: +1 and -2 points; mean -0.5, sd 2.1213, half width 12.7062 * 1.5 = 19.06
    versus = arms["sidco-exp"]["points_vs_none"]
    assert versus["mean"] == pytest.approx(-0.5)
    assert versus["high"] - versus["mean"] == pytest.approx(19.06, abs=0.01)


def test_the_training_runs_go_over_the_link_at_their_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = []

    def fake_run(command: list[str], **_: object) -> None:  # a run that writes what is kept
        commands.append(command)
        out = Path(command[command.index("--out") + 1])
        out.mkdir(parents=True)
        for name in ("summary.json", "evals.jsonl"):
            (out / name).write_text(name)

    monkeypatch.setattr("subprocess.run", fake_run)
    training_seeds.train(["bf16"], [2], tmp_path, resume=False)
    (line,) = commands
    last = {
        flag: line[len(line) - 1 - line[::-1].index(flag) + 1]
        for flag in ("--seed", "--bandwidth", "--compressor")
    }
    assert last == {
        "--seed": "2",
        "--bandwidth": "100mbit",
        "--compressor": "bf16",
    }  # the last of a flag wins
    assert (tmp_path / "bf16-s2" / "evals.jsonl").read_text() == "evals.jsonl"
    commands.clear()
    training_seeds.train(["topk", "vgc"], [0], tmp_path, resume=False)  # the main grid's other arms
    topk, vgc = commands
    assert topk[topk.index("--compressor") + 1 :][:3] == ["topk", "--ratio", "0.01"]
    assert vgc[vgc.index("--compressor") + 1] == "vgc" and "--ratio" not in vgc


def _loss_run(loss: float, workers: int = 2) -> dict[str, float]:
    return {
        "workers": workers,
        "final_test_loss": loss,
        "bytes_sent_per_step": 8.0,
        "bytes_received_per_step": 12.0,
    }


def test_the_powersgd_rank_summary_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import powersgd_rank

    protocol, own = tmp_path / "protocol", tmp_path / "own"
    monkeypatch.setattr(powersgd_rank, "PROTOCOL_RUNS", protocol)
    monkeypatch.setattr(powersgd_rank, "RUNS", own)
    losses = {
        "none": [2.0, 2.0, 2.5],
        "bf16": [2.0, 2.0, 2.5],
        "alone": [2.2, 2.1, 2.4],
        "powersgd-r1": [2.3, 2.2, 2.6],
        "powersgd-r2": [2.02, 2.04, 2.5],
        "powersgd-r4": [2.0, 2.0, 2.5],
        "topk-dense": [2.1, 2.0, 2.5],
    }
    for arm in powersgd_rank.OWN_ARMS["gpt-adamw"]:  # the ways out of the recipe: fp32's losses
        if arm != "repeat":
            losses.setdefault(arm, losses["none"])
    for arm, by_seed in losses.items():
        for seed, loss in enumerate(by_seed):
            if arm in powersgd_rank.BASELINES:  # the protocol's committed runs
                folder = protocol / "gpt-adamw" / f"{arm}-e0.3-s{seed}"
            else:
                folder = own / "gpt-adamw" / f"{arm}-s{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(_loss_run(loss, 1 if arm == "alone" else 2)))
    (own / "gpt-adamw" / "repeat-s0").mkdir()
    (own / "gpt-adamw" / "repeat-s0" / "summary.json").write_text(json.dumps(_loss_run(2.0001)))
    summary = powersgd_rank.summarize_workload("gpt-adamw", [0, 1, 2])
    arms = summary["arms"]
    assert summary["unit"] == "% of fp32's loss"
    # rank 2 against fp32 per seed: +1 %, +2 %, 0 %: mean 1, sd 1, half width 4.3027 / sqrt(3)
    half = T3 / math.sqrt(3)
    assert arms["powersgd-r2"]["vs_none"] == pytest.approx(
        {"mean": 1.0, "low": 1.0 - half, "high": 1.0 + half}
    )
    assert arms["powersgd-r2"]["mean"] == pytest.approx(6.56 / 3)
    # lower loss beats the worker alone: 2.02 < 2.2, 2.04 < 2.1, not 2.5 < 2.4; rank 1 on none
    assert arms["powersgd-r2"]["seeds_beating_alone"] == 2
    assert arms["powersgd-r1"]["seeds_beating_alone"] == 0
    assert "vs_none" not in arms["none"] and "seeds_beating_alone" not in arms["alone"]
    # the worker alone sends and receives nothing; the others' medians are their runs' 8 and 12
    assert arms["alone"]["bytes_sent_per_step"] == arms["alone"]["bytes_received_per_step"] == 0.0
    assert (arms["topk-dense"]["bytes_sent_per_step"], arms["topk-dense"]["bytes_received_per_step"]) == (
        8.0,
        12.0,
    )
    assert summary["repeat_seed0"] == {"committed": 2.0, "rerun": 2.0001}


def test_the_powersgd_rank_mlp_arms_are_the_quantizer_comparison_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import powersgd_rank

    monkeypatch.setattr(compare, "RUNS", tmp_path)
    accuracy = {"none": [0.80, 0.82, 0.81], "bf16": [0.80, 0.82, 0.81], "alone": [0.70, 0.83, 0.72],
                "powersgd-r1": [0.70, 0.76, 0.73], "powersgd-r2": [0.79, 0.80, 0.82],
                "powersgd-r4": [0.80, 0.82, 0.81], "powersgd-r8": [0.80, 0.82, 0.81]}  # fmt: skip
    _write_quantizer_runs(
        tmp_path,
        {arm: [_quantizer_run(a, None, workers=1 if arm == "alone" else 4) for a in by_seed]
         for arm, by_seed in accuracy.items()},
    )  # fmt: skip
    arms = powersgd_rank.summarize_workload("mlp", [0, 1, 2])["arms"]
    # rank 1 against fp32: -10, -6, -8 points: mean -8, sd 2, half width 4.3027 * 2 / sqrt(3)
    half = T3 * 2 / math.sqrt(3)
    assert arms["powersgd-r1"]["vs_none"] == pytest.approx(
        {"mean": -8.0, "low": -8.0 - half, "high": -8.0 + half}
    )
    # higher accuracy beats the worker alone: rank 1 only on seed 2 (0.73 > 0.72), rank 2 on 0 and 2
    assert arms["powersgd-r1"]["seeds_beating_alone"] == 1
    assert arms["powersgd-r2"]["seeds_beating_alone"] == 2
