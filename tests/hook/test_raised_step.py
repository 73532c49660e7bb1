"""A raised step (a malformed message, a NaN under ``nonfinite="raise"``) is dropped on every
rank alike: every rank raises the same error from ``optimizer.step()`` (the step settles
there, after backward returned) before any parameter moves, every parameter's ``.grad`` is
None, and the job can go on: a rank that catches the error and takes the next batch trains
in step with the others (DDP's futures completed, its reducer untouched).

Rank 1 corrupts its message's first length word (beyond the payload's capacity) after the
hook packed it, or feeds a NaN: two gloo ranks, one step of each case between good ones.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import NonFiniteGradientError, WireFormatError
from support.distributed import run_workers
from support.models import batch, make_model


def _corrupt_lengths(pack):
    """``MessageLayout.pack`` whose message claims more entries than its first payload holds."""

    def pack_corrupted(self, payloads, nonfinite, into=None):
        message = pack(self, payloads, nonfinite, into)
        header = message[:8].clone().view(torch.int32)
        header[1] = 1_000_000  # part 0's length
        message[:8] = header.view(torch.uint8)
        return message

    return pack_corrupted


def worker(rank: int, world: int, case: str) -> dict:
    from gradsift.core import wire

    model = DDP(make_model())
    gradsift.register_comm_hook(model, "topk", ratio=0.1, nonfinite="raise")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step: int) -> None:
        optimizer.zero_grad()
        x, y = batch(rank, step)
        if rank == 1 and case == "nonfinite" and step == 1:
            x[0, 0] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    train(0)  # a good step
    before = [p.detach().clone() for p in model.parameters()]
    pack = wire.MessageLayout.pack
    if rank == 1 and case == "malformed":
        wire.MessageLayout.pack = _corrupt_lengths(pack)
    error = None
    try:
        train(1)
    except (WireFormatError, NonFiniteGradientError) as raised:
        error = f"{type(raised).__name__}: {raised}"
    wire.MessageLayout.pack = pack
    unmoved = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    grads_none = all(p.grad is None for p in model.parameters())
    train(2)  # going on: the next batch
    return {
        "error": error,
        "grads_none": grads_none,
        "unmoved": unmoved,
        "before": before,
        "after": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "kind"), [("malformed", "WireFormatError"), ("nonfinite", "NonFiniteGradientError")]
)
def test_a_raised_step_is_dropped_on_every_rank_and_training_goes_on(case: str, kind: str) -> None:
    results = run_workers(__file__, "worker", 2, case=case, timeout=90)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None and error.startswith(kind), (rank, error)
        assert (
            "Every rank raises this at the same point" in error
            and "the step is dropped on every rank" in error
        )
        assert result["grads_none"], rank
        assert result["unmoved"], rank  # raised before the optimizer moved a parameter
    for before, after in zip(results[0]["before"], results[1]["before"], strict=True):
        assert torch.equal(before, after)  # the good step was synchronised
    for first, second in zip(results[0]["after"], results[1]["after"], strict=True):
        assert torch.equal(first, second)  # and so is the step after the raised one
    assert any(
        not torch.equal(a, b) for a, b in zip(results[0]["before"], results[0]["after"], strict=True)
    )  # the step after it trained
    if case == "malformed":
        assert "from rank(s) [1]" in results[0]["error"]
    else:
        assert "nonfinite='skip'" in results[0]["error"]
    assert results[0]["error"] == results[1]["error"]
