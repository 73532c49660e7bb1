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
    (folder / "summary.json").write_text(
        json.dumps({"bytes_sent_per_step": 10.0, "bytes_received_per_step": 30.0})
    )


def _write_runs(folder: Path, curves: dict[str, dict[int, list[tuple[int, float]]]]) -> None:
    for arm, seeds in curves.items():
        for seed, curve in seeds.items():
            _write(folder / f"{arm}-s{seed}", curve)


def _fake_training(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The ``gradsift train`` commands a batch runs, recorded, each writing empty kept files; the
    other commands (a stamp's git) run."""
    commands: list[list[str]] = []
    real_run = vgg_seeds.subprocess.run

    def fake_run(command: list[str], **kwargs: Any) -> Any:
        if "gradsift" not in command:
            return real_run(command, **kwargs)
        commands.append(command)
        run = Path(command[command.index("--out") + 1])
        run.mkdir(parents=True)
        for name in vgg_seeds.KEPT:
            (run / name).write_text("{}")
        return None

    monkeypatch.setattr(vgg_seeds.subprocess, "run", fake_run)
    return commands


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
    _write_runs(tmp_path, curves)
    monkeypatch.setattr(vgg_longer.composed, "analyze_links", lambda *args: [])
    result = vgg_longer.analyze([0, 1], tmp_path)
    # fp32's final 0.88 on both seeds; the target 0.88 - 0.005 = 0.875
    assert result["target"] == pytest.approx(0.875)
    assert result["steps_to_target"] == {"none": [400, 400], "bf16": [400, 400], "sidco-exp": [200, 300]}
    # second half (steps 300, 400): none 0.87, 0.875; sidco-exp 0.88, 0.89 -> +1.0 and +1.5 points;
    # mean 1.25, sd 0.3536, t(1) 12.7062: half width 12.7062 * 0.3536 / sqrt(2) = 3.1765
    versus = result["second_half_points_vs_none"]["sidco-exp"]
    assert versus["mean"] == pytest.approx(1.25)
    assert (versus["low"], versus["high"]) == (
        pytest.approx(1.25 - 3.1765, abs=1e-3),
        pytest.approx(1.25 + 3.1765, abs=1e-3),
    )


def test_a_resumed_batch_trains_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _fake_training(monkeypatch)
    (tmp_path / "none-s0").mkdir()
    (tmp_path / "none-s0" / "summary.json").write_text("{}")
    arms = {"none": ["--compressor", "none"], "bf16": ["--compressor", "bf16"]}
    vgg_seeds.train_kept(arms, [0], tmp_path, ("--steps", "1000"), resume=True)
    assert len(commands) == 1 and commands[0][commands[0].index("--compressor") + 1] == "bf16"
    # the longer length comes after the composition's own --steps 200, so it is the one that counts
    assert commands[0][commands[0].index("--steps", commands[0].index("--steps") + 1) + 1] == "1000"
    assert (tmp_path / "bf16-s0" / "evals.jsonl").is_file()


def test_the_second_cnn_trains_resnet20_with_the_compositions_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import second_cnn

    commands = _fake_training(monkeypatch)
    first = ["run", "--seeds", "0", "--steps", "30", "--out", str(tmp_path), "--arms", "none", "sidco-exp"]
    assert second_cnn.main(first) == 0
    assert [c[c.index("--compressor") + 1] for c in commands] == ["none", "sidco-exp"]
    # a later batch trains the controls only, and its stamp goes beside the first's
    assert second_cnn.main(["run", "--seeds", "0", "--steps", "30", "--out", str(tmp_path)]) == 0
    assert [c[c.index("--out") + 1].rsplit("/", 1)[1] for c in commands[2:]] == [
        "topk-dense-s0", "sidco-exp-no-recipe-s0", "alone-s0"
    ]  # fmt: skip
    stamps = {path.name: json.loads(path.read_text())["arms"] for path in tmp_path.glob("provenance-*.json")}
    assert stamps == {"provenance-s0.json": ["none", "sidco-exp"],
                      "provenance-s0-2.json": ["topk-dense", "sidco-exp-no-recipe", "alone"]}  # fmt: skip
    assert second_cnn.main(["run", "--seeds", "0", "--steps", "30", "--out", str(tmp_path)]) == 0
    assert len(commands) == 5 and len(list(tmp_path.glob("provenance-*.json"))) == 2  # nothing left: no stamp
    alone = commands[4]
    assert [alone[i + 1] for i, flag in enumerate(alone) if flag == "--workers"][-1] == "1"
    # the VGG composition's flags first, then the model and the length: the last of each wins
    for command in commands:
        models = [command[i + 1] for i, flag in enumerate(command) if flag == "--model"]
        steps = [command[i + 1] for i, flag in enumerate(command) if flag == "--steps"]
        assert models == ["vgg", "resnet20"] and steps[-1] == "30"
        assert command[command.index("--lr") + 1] == "0.05" and command[command.index("--workers") + 1] == "4"
    assert (tmp_path / "sidco-exp-s0" / "evals.jsonl").is_file()


def test_the_second_cnn_analysis_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import second_cnn

    curves = {  # fp32 ends at 0.90 and 0.92: the target 0.91 - 0.005 = 0.905
        "none": {0: [(50, 0.70), (100, 0.85), (150, 0.88), (200, 0.90)],
                 1: [(50, 0.72), (100, 0.86), (150, 0.91), (200, 0.92)]},
        "sidco-exp": {0: [(50, 0.75), (100, 0.91), (150, 0.90), (200, 0.89)],
                      1: [(50, 0.71), (100, 0.84), (150, 0.88), (200, 0.90)]},
    }  # fmt: skip
    _write_runs(tmp_path, curves)
    out = tmp_path / "result.json"
    arguments = ["analyze", "--arms", "none", "sidco-exp", "--seeds", "0", "1", "--out", str(tmp_path)]
    assert second_cnn.main([*arguments, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "resnet20" and result["target"] == pytest.approx(0.905)
    # none: seed 0 never reaches 0.905, seed 1 at 150; sidco-exp: seed 0 at 100, seed 1 never
    assert result["steps_to_target"] == {"none": [None, 150], "sidco-exp": [100, None]}
    # second half (150, 200): none 0.89, 0.915; sidco-exp 0.895, 0.89 -> +0.5 and -2.5 points, mean -1.0
    assert result["second_half_points_vs_none"]["sidco-exp"]["mean"] == pytest.approx(-1.0)
    assert "steps to the target [100, None]" in capsys.readouterr().out
    assert result["bytes_per_step"]["sidco-exp"] == {"sent": [10.0, 10.0], "received": [30.0, 30.0]}
