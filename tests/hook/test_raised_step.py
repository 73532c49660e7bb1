"""A raised step (a malformed message, a NaN under ``nonfinite="raise"``) leaves no rank with
gradients of its own: every rank raises the same error, every parameter's ``.grad`` is None,
and the error says the job must stop -- DDP runs no further backward after its hook failed,
which the last check confirms on the torch in use.

Rank 1 corrupts its message's first length word (beyond the payload's capacity) after the
hook packed it, or feeds a NaN: two gloo ranks, one step of each case after a good one.
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

    def pack_corrupted(self, payloads, nonfinite):
        message = pack(self, payloads, nonfinite)
        header = message[:8].clone().view(torch.int32)
        header[1] = 1_000_000  # part 0's length
        message[:8] = header.view(torch.uint8)
        return message

    return pack_corrupted


def worker(rank: int, world: int, case: str) -> dict:
    from gradsift.core import wire

    model = DDP(make_model())
    gradsift.register_comm_hook(model, "topk", ratio=0.1, nonfinite="raise")
    x, y = batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()  # a good step
    kept = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x, y = batch(rank, 1)
    if rank == 1 and case == "malformed":
        wire.MessageLayout.pack = _corrupt_lengths(wire.MessageLayout.pack)
    if rank == 1 and case == "nonfinite":
        x[0, 0] = float("nan")
    error = None
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except (WireFormatError, NonFiniteGradientError) as raised:
        error = f"{type(raised).__name__}: {raised}"
    grads = [p.grad for p in model.parameters()]
    try:  # what the error tells the caller: DDP takes no further backward
        torch.nn.functional.mse_loss(model(x), y).backward()
        again = None
    except RuntimeError as raised:
        again = str(raised)
    return {"error": error, "grads_none": all(g is None for g in grads), "again": again, "good": kept}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "kind"), [("malformed", "WireFormatError"), ("nonfinite", "NonFiniteGradientError")]
)
def test_a_raised_step_leaves_no_unsynchronised_gradient_and_says_the_job_must_stop(
    case: str, kind: str
) -> None:
    results = run_workers(__file__, "worker", 2, case=case, timeout=90)
    assert torch.equal(results[0]["good"][0], results[1]["good"][0])  # the good step was synchronised
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None and error.startswith(kind), (rank, error)
        assert "Every rank raises this from backward()" in error and "The job must stop" in error
        assert "restart from the last checkpoint" in error
        assert result["grads_none"], rank
        assert result["again"] is not None, rank  # the reason the job must stop
    if case == "malformed":
        assert "from rank(s) [1]" in results[0]["error"]
    else:
        assert "nonfinite='skip'" in results[0]["error"]
    assert results[0]["error"] == results[1]["error"]
