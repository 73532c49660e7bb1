"""The examples, run by their documented commands, compress for real and resume exactly.

``docs/integrations.md`` documents each example as a pair of commands that name the method
(``--compressor topk --ratio 0.01``): train with a checkpoint half way, then resume from that
checkpoint into another folder; each DDP script's docstring shows the same pair with the
default, ``auto``. The suite runs those pairs as written (``tests/support/doc_commands.py``; the runs are shared with
``tests/project/test_docs.py``). Each run prints one ``gradsift-example {json}`` line on rank 0.
The resumed run must print the same summary and land on bit-identical parameters,
optimizer state and hook residuals -- which only holds when the saved hook state was
really restored (the control with zeroed residuals shows that it matters). Under ``auto``
the summary names the method it ran, and the bytes sent must be that method's.
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

from gradsift.hook.choice import CANDIDATES
from support import ROOT
from support.doc_commands import EXAMPLES_GROUP, BlockRun, DocumentedRuns, summary_line

EXAMPLES = ROOT / "examples"
PAGE = "docs/integrations.md"
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group(EXAMPLES_GROUP)]


def documented_pair(
    runs: DocumentedRuns, script: str, source: str = PAGE
) -> tuple[BlockRun, dict[str, Any], dict[str, Any]]:
    """The documented train + resume block of ``script`` on ``source``: its run and the two
    summary lines."""
    block = runs.find(f"examples/{script}", source=source)
    result = runs.run(block)
    assert result.ok and len(result.runs) == 2, "\n\n".join(r.describe() for r in result.runs)
    full, resumed = (summary_line(run.output) for run in result.runs)
    return result, full, resumed


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
    return [rank["store"]["tables"]["residual"] for rank in hooks["ranks"]]


def assert_compressed_run(summary: dict[str, Any], steps: int, dense_steps: int = 0) -> None:
    """``steps`` taken, replicas equal, and ``topk`` at 1 % (+ 4-byte indices) after
    ``dense_steps`` dense ones (Adam's warm-up) under 5 % of the dense bytes."""
    assert summary["step"] == steps
    assert summary["replicas_agree"] is True
    bound = (dense_steps + 0.05 * (steps - dense_steps)) / steps
    assert 0 < summary["bytes_sent"] < bound * summary["dense_bytes"]


def assert_resumed_exactly(full: dict[str, Any], resumed: dict[str, Any], keys: tuple[str, str, str]) -> None:
    """Model, optimizer state and every rank's residuals bit-identical; ``keys`` name them in the checkpoint."""
    model, optimizer, hooks = keys
    assert_same_tensors(full[model], resumed[model], "model")
    assert_same_tensors(full[optimizer], resumed[optimizer], "optimizer")
    assert_same_tensors(residuals(full[hooks]), residuals(resumed[hooks]), "residuals")
    assert any(bool(r.abs().sum() > 0) for rank in residuals(full[hooks]) for r in rank.values())


PLAIN_KEYS = ("model", "optimizer", "gradsift")


def test_torchrun_example_compresses_and_resumes_exactly(documented_runs: DocumentedRuns) -> None:
    result, full, resumed = documented_pair(documented_runs, "ddp_torchrun.py")
    assert_compressed_run(full, steps=40)
    assert resumed == full  # same loss, bytes and density: telemetry totals resume too
    here = result.directory
    assert_resumed_exactly(
        load(here / "checkpoints" / "last.pt"), load(here / "resumed" / "last.pt"), PLAIN_KEYS
    )

    # Control: the same checkpoint without its residuals does not reproduce the run.
    middle = load(here / "checkpoints" / "step20.pt")
    for rank in residuals(middle["gradsift"]):
        for tensor in rank.values():
            tensor.zero_()
    control = here.parent / "control"
    control.mkdir()
    torch.save(middle, control / "no-residuals.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / "ddp_torchrun.py"), "--compressor", "topk", "--ratio", "0.01", "--steps", "40",
               "--resume", "no-residuals.pt"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=control, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    full_model = load(here / "checkpoints" / "last.pt")["model"]
    control_model = load(control / "checkpoints" / "last.pt")["model"]
    assert not all(torch.equal(full_model[k], control_model[k]) for k in full_model)


def test_accelerate_example_launched_by_accelerate_resumes_exactly(
    documented_runs: DocumentedRuns,
) -> None:
    result, full, resumed = documented_pair(documented_runs, "accelerate_example.py")
    assert result.runs[0].command.startswith("accelerate launch --multi_gpu --num_processes 2 ")
    assert_compressed_run(full, steps=40)
    assert resumed == full
    here = result.directory
    assert_resumed_exactly(
        load(here / "checkpoints" / "last.pt"), load(here / "resumed" / "last.pt"), PLAIN_KEYS
    )


def test_lightning_example_compresses_logs_and_resumes_exactly(documented_runs: DocumentedRuns) -> None:
    result, full, resumed = documented_pair(documented_runs, "lightning_example.py")
    assert_compressed_run(full, steps=16)  # 512 samples / (2 ranks x 32) = 8 steps per epoch
    here = result.directory
    logged = (here / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "gradsift/total/bytes_sent" in logged[0].split(",")
    assert resumed == full
    full_ckpt, resumed_ckpt = (load(here / d / "epoch=1.ckpt") for d in ("checkpoints", "resumed"))
    for checkpoint in (full_ckpt, resumed_ckpt):
        checkpoint["hooks"] = checkpoint["callbacks"]["GradsiftCallback"]
    assert_resumed_exactly(full_ckpt, resumed_ckpt, ("state_dict", "optimizer_states", "hooks"))


def test_hf_trainer_example_compresses_and_resumes_exactly_from_the_trainers_checkpoint(
    documented_runs: DocumentedRuns,
) -> None:
    safetensors = pytest.importorskip("safetensors.torch", reason="pip install 'gradsift[transformers]'")
    result, full, resumed = documented_pair(documented_runs, "hf_trainer_example.py")
    assert_compressed_run(full, steps=40, dense_steps=4)  # the Trainer's AdamW: a tenth of the steps dense
    assert resumed == full  # the final model's loss, bytes and density
    full_dir, resumed_dir = (result.directory / d / "checkpoint-40" for d in ("checkpoints", "resumed"))
    model = [safetensors.load_file(d / "model.safetensors") for d in (full_dir, resumed_dir)]
    optimizer = [load(d / "optimizer.pt") for d in (full_dir, resumed_dir)]
    hooks = [
        {"ranks": [load(d / f"gradsift_hook_state_{rank}.pt")["hook"] for rank in range(2)]}
        for d in (full_dir, resumed_dir)
    ]
    assert_resumed_exactly(
        {"model": model[0], "optimizer": optimizer[0], "hooks": hooks[0]},
        {"model": model[1], "optimizer": optimizer[1], "hooks": hooks[1]},
        ("model", "optimizer", "hooks"),
    )
    # every rank saved its own state in the Trainer's mid-run checkpoint, beside rng_state_RANK.pth
    middle = result.directory / "checkpoints" / "checkpoint-20"
    assert {p.name for p in middle.glob("gradsift_hook_state_*.pt")} == {
        "gradsift_hook_state_0.pt",
        "gradsift_hook_state_1.pt",
    }
    assert all(load(middle / f"gradsift_hook_state_{r}.pt")["global_step"] == 20 for r in range(2))


HF_MEASURED = ROOT / "results" / "integrations" / "hf_trainer.json"


def test_hf_trainer_example_stays_within_its_measured_gap_to_the_trainer_alone(
    documented_runs: DocumentedRuns,
) -> None:
    """The documented 300-step comparison (seed 0): gradsift's loss over the Trainer alone's
    within the ratio measured over 3 seeds (mean + 3 sd, from the committed benchmark), error
    feedback alone beyond its own measured mean - 3 sd, and the recipe ahead of it."""
    block = documented_runs.find("--without-gradsift", source=PAGE)
    result = documented_runs.run(block)
    assert result.ok and len(result.runs) == 3, "\n\n".join(r.describe() for r in result.runs)
    gradsift, plain, alone = (summary_line(run.output) for run in result.runs)
    measured = json.loads(HF_MEASURED.read_text())["summary"]
    for run in (gradsift, plain, alone):
        assert run["step"] == 300 and run["replicas_agree"] is True
    assert 0 < gradsift["bytes_sent"] < (30 + 0.05 * 270) / 300 * gradsift["dense_bytes"]
    ratio, plain_ratio = gradsift["loss"] / alone["loss"], plain["loss"] / alone["loss"]
    assert ratio <= measured["gradsift"]["ratio_mean"] + 3 * measured["gradsift"]["ratio_sd"]
    assert plain_ratio >= measured["plain"]["ratio_mean"] - 3 * measured["plain"]["ratio_sd"]
    assert gradsift["loss"] < plain["loss"]


@pytest.mark.parametrize(
    "script,family",
    [
        ("ddp_torchrun.py", "sgd"),
        ("accelerate_example.py", "sgd"),
        ("lightning_example.py", "sgd"),
        ("hf_trainer_example.py", "adam"),
    ],
)
def test_example_defaults_to_auto_runs_what_it_chose_and_resumes_it(
    documented_runs: DocumentedRuns, script: str, family: str
) -> None:
    """The docstring's plain pair (no ``--compressor``): ``auto`` ran one of its candidates for
    the script's optimizer (SGD with momentum; the Trainer's AdamW, a 40-step run: no 1-bit
    method), the bytes sent are that method's (``none`` under AdamW: every step dense, as stock
    DDP sends; otherwise fewer -- under SGD the measuring steps run sidco-exp), and the resumed run -- from a checkpoint after the decision, which it
    restores -- prints the same summary."""
    if script == "hf_trainer_example.py":
        pytest.importorskip("transformers", reason="pip install 'gradsift[transformers]'")
    _, full, resumed = documented_pair(documented_runs, script, source=f"examples/{script}")
    assert full["compressor"] in {name for name, _ in CANDIDATES[family]}
    assert full["replicas_agree"] is True
    if full["compressor"] == "none" and family != "sgd":
        assert full["bytes_sent"] == full["dense_bytes"]
    else:  # a compressed method, or under SGD the measuring steps on sidco-exp
        assert 0 < full["bytes_sent"] < full["dense_bytes"]
    assert resumed == full
