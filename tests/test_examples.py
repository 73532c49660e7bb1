"""The examples run as written on 2 CPU processes, compress for real, and resume exactly.

Each example is launched the way its docstring says (torchrun / Lightning's own
launcher), trains a few steps, and prints one ``gradsift-example {json}`` line on rank 0.
Resuming from a mid-run checkpoint must land on bit-identical parameters, optimizer
state and hook residuals as the uninterrupted run -- which only holds when the saved
hook state was really restored (the control with zeroed residuals shows it matters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def launch(tmp_path: Path, script: str, *args: str, torchrun: bool = True) -> dict[str, Any]:
    """Run an example on 2 CPU processes in ``tmp_path``; return its rank-0 summary line."""
    command = [sys.executable, str(EXAMPLES / script), *args]
    if torchrun:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("gradsift-example ")]
    assert len(lines) == 1, output[-6000:]
    return json.loads(lines[0].removeprefix("gradsift-example "))


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """Recursive bit-exact equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def residuals(hooks: dict[str, Any]) -> list[dict[Any, torch.Tensor]]:
    """Per-rank residuals from the ``gather_hook_states`` dict of a checkpoint."""
    return [rank["feedback"]["residuals"] for rank in hooks["ranks"]]


def assert_compressed_run(summary: dict[str, Any], steps: int) -> None:
    assert summary["step"] == steps
    assert summary["replicas_agree"] is True
    assert 0 < summary["bytes_sent"] < 0.05 * summary["dense_bytes"]  # topk at 1% (+ 4-byte indices)


def assert_resumed_exactly(full: dict[str, Any], resumed: dict[str, Any], keys: tuple[str, str, str]) -> None:
    """Model, optimizer state and every rank's residuals bit-identical; ``keys`` name them in the checkpoint."""
    model, optimizer, hooks = keys
    assert_same_tensors(full[model], resumed[model], "model")
    assert_same_tensors(full[optimizer], resumed[optimizer], "optimizer")
    assert_same_tensors(residuals(full[hooks]), residuals(resumed[hooks]), "residuals")
    assert any(bool(r.abs().sum() > 0) for rank in residuals(full[hooks]) for r in rank.values())


PLAIN_KEYS = ("model", "optimizer", "gradsift")


def test_torchrun_example_compresses_and_resumes_exactly(tmp_path: Path) -> None:
    common = ["--steps", "8"]
    full = launch(tmp_path, "ddp_torchrun.py", *common, "--checkpoint-every", "4")
    assert_compressed_run(full, steps=8)
    middle = load(tmp_path / "checkpoints" / "step4.pt")
    resumed = launch(
        tmp_path,
        "ddp_torchrun.py",
        *common,
        "--resume",
        "checkpoints/step4.pt",
        "--checkpoint-dir",
        "resumed",
    )
    assert resumed == full  # same loss, bytes and density: telemetry totals resume too
    assert_resumed_exactly(
        load(tmp_path / "checkpoints" / "last.pt"), load(tmp_path / "resumed" / "last.pt"), PLAIN_KEYS
    )

    # Control: the same checkpoint without its residuals does not reproduce the run.
    for rank in residuals(middle["gradsift"]):
        for tensor in rank.values():
            tensor.zero_()
    torch.save(middle, tmp_path / "no-residuals.pt")
    launch(tmp_path, "ddp_torchrun.py", *common, "--resume", "no-residuals.pt", "--checkpoint-dir", "control")
    full_model, control_model = (
        load(tmp_path / "checkpoints" / "last.pt")["model"],
        load(tmp_path / "control" / "last.pt")["model"],
    )
    assert not all(torch.equal(full_model[k], control_model[k]) for k in full_model)


def test_accelerate_example_compresses_and_resumes_exactly(tmp_path: Path) -> None:
    full = launch(tmp_path, "accelerate_example.py", "--steps", "8", "--checkpoint-every", "4")
    assert_compressed_run(full, steps=8)
    resumed = launch(
        tmp_path,
        "accelerate_example.py",
        "--steps",
        "8",
        "--resume",
        "checkpoints/step4.pt",
        "--checkpoint-dir",
        "resumed",
    )
    assert resumed == full
    assert_resumed_exactly(
        load(tmp_path / "checkpoints" / "last.pt"), load(tmp_path / "resumed" / "last.pt"), PLAIN_KEYS
    )


def test_lightning_example_compresses_logs_and_resumes_exactly(tmp_path: Path) -> None:
    full = launch(tmp_path, "lightning_example.py", "--epochs", "2", torchrun=False)
    assert_compressed_run(full, steps=16)  # 512 samples / (2 ranks x 32) = 8 steps per epoch
    logged = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "gradsift/total/bytes_sent" in logged[0].split(",")
    resumed = launch(
        tmp_path, "lightning_example.py", "--epochs", "2", "--resume", "checkpoints/epoch=0.ckpt",
        "--checkpoint-dir", "resumed", torchrun=False,
    )  # fmt: skip
    assert resumed == full
    full_ckpt, resumed_ckpt = (load(tmp_path / d / "epoch=1.ckpt") for d in ("checkpoints", "resumed"))
    for checkpoint in (full_ckpt, resumed_ckpt):
        checkpoint["hooks"] = checkpoint["callbacks"]["GradsiftCallback"]
    assert_resumed_exactly(full_ckpt, resumed_ckpt, ("state_dict", "optimizer_states", "hooks"))
