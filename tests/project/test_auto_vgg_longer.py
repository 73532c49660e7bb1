"""benchmarks/auto/vgg_longer.py: the second half's accuracy, its paired difference, resuming.

Oracle: tiny synthetic runs written as ``evals.jsonl`` files, each answer worked out by hand in
the comments; the resume by the commands a fake ``subprocess.run`` receives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "auto"))
import vgg_longer
import vgg_seeds


def _write(folder: Path, curve: list[tuple[int, float]]) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": step, "accuracy": accuracy, "loss": 1.0}) for step, accuracy in curve]
    (folder / "evals.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text("{}")


def test_the_second_half_by_hand() -> None:
    # last step 400: the second half is the evaluations past step 200 -> (0.8 + 0.9) / 2
    assert vgg_longer.second_half([(100, 0.1), (200, 0.5), (300, 0.8), (400, 0.9)]) == pytest.approx(0.85)


def test_steps_and_paired_difference_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    curves = {  # per arm, per seed: evaluations at steps 100..400
        "none": {0: [(100, 0.80), (200, 0.84), (300, 0.86), (400, 0.88)],
                 1: [(100, 0.81), (200, 0.85), (300, 0.87), (400, 0.88)]},
        "bf16": {0: [(100, 0.80), (200, 0.84), (300, 0.86), (400, 0.88)],
                 1: [(100, 0.81), (200, 0.85), (300, 0.87), (400, 0.88)]},
        "sidco-exp": {0: [(100, 0.83), (200, 0.88), (300, 0.88), (400, 0.88)],
                      1: [(100, 0.84), (200, 0.87), (300, 0.89), (400, 0.89)]},
    }  # fmt: skip
    for arm, seeds in curves.items():
        for seed, curve in seeds.items():
            _write(tmp_path / f"{arm}-s{seed}", curve)
    monkeypatch.setattr(vgg_longer.composed, "analyze_links", lambda *args: [])
    result = vgg_longer.analyze([0, 1], tmp_path)
    # fp32's final 0.88 on both seeds; the target 0.88 - 0.005 = 0.875
    assert result["target"] == pytest.approx(0.875)
    assert result["steps_to_target"] == {"none": [400, 400], "bf16": [400, 400], "sidco-exp": [200, 300]}
    # second half (steps 300, 400): none 0.87, 0.875; sidco-exp 0.88, 0.89 -> +1.0 and +1.5 points;
    # mean 1.25, sd 0.3536, t(1) 12.706: half width 12.706 * 0.3536 / sqrt(2) = 3.1765
    versus = result["second_half_points_vs_none"]["sidco-exp"]
    assert versus["mean"] == pytest.approx(1.25)
    assert (versus["low"], versus["high"]) == (
        pytest.approx(1.25 - 3.1765, abs=1e-3),
        pytest.approx(1.25 + 3.1765, abs=1e-3),
    )


def test_a_resumed_batch_trains_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> None:
        commands.append(command)
        run = Path(command[command.index("--out") + 1])
        run.mkdir(parents=True)
        for name in vgg_seeds.KEPT:
            (run / name).write_text("{}")

    monkeypatch.setattr(vgg_seeds.subprocess, "run", fake_run)
    (tmp_path / "none-s0").mkdir()
    (tmp_path / "none-s0" / "summary.json").write_text("{}")
    arms = {"none": ["--compressor", "none"], "bf16": ["--compressor", "bf16"]}
    vgg_seeds.train_kept(arms, [0], tmp_path, ("--steps", "1000"), resume=True)
    assert len(commands) == 1 and commands[0][commands[0].index("--compressor") + 1] == "bf16"
    # the longer length comes after the composition's own --steps 200, so it is the one that counts
    assert commands[0][commands[0].index("--steps", commands[0].index("--steps") + 1) + 1] == "1000"
    assert (tmp_path / "bf16-s0" / "evals.jsonl").is_file()
