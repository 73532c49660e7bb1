"""Every compressor with a parameter of no elements, first in the model.

A parameter of zero elements (a placeholder, a zero-width adapter) takes no room in DDP's
bucket, yet DDP lists it among the bucket's parameters -- first, when the model registers it
first. The hook's first-step check read the first parameter's delivered gradient to see a
`GradScaler`'s unscaling, and crashed on an empty one (`argmax` of no elements); PowerSGD,
which runs PyTorch's hook (it views each gradient as a matrix), is refused by name. The oracles:
stock DDP in the same worker (`none` equals it bit for bit), every step's loss finite and the
ranks equal for every registry name under SGD with momentum and under AdamW, on 2 real gloo
ranks, past the dense warm-up; and a `GradScaler` the hook cannot adopt (one of two) still
seen unscaling at the first step and refused, as on a model without the empty parameter.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers
from support.every_compressor import OPTIONS, each_case, each_family_and_name, optimizer_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 5


class EmptyFirst(torch.nn.Module):
    """A parameter of no elements registered before the layers every step uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.body = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(inputs))) + self.empty.sum()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * rank + step))


def train(rank: int, family: str, name: str | None) -> dict:
    """``name`` None is stock DDP."""
    model = EmptyFirst()
    ddp = DDP(model)
    if name is not None:
        try:
            gradsift.register_comm_hook(ddp, name, warmup_steps=2, **OPTIONS.get(name, {}))
        except InvalidOptionError as refusal:
            return {"refused": str(refusal)}
    optimizer = optimizer_for(family, ddp.parameters())
    losses = []
    for step in range(STEPS):
        inputs = batch(rank, step)
        optimizer.zero_grad()
        loss = (ddp(inputs) - inputs[:, :8]).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "parameters": torch.cat([p.detach().flatten() for p in model.parameters()])}


def scaler_found(rank: int) -> str | None:
    """A `GradScaler` unscales what the hook delivered, without ``scaler=`` and beside a second
    one (so the hook cannot tell which to adopt): the first step's refusal's text."""
    ddp = DDP(EmptyFirst())
    gradsift.register_comm_hook(ddp, "topk", ratio=0.1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler, other = torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.amp.GradScaler("cpu")
    other.scale(torch.ones(()))
    try:
        for step in range(2):
            inputs = batch(rank, step)
            optimizer.zero_grad()
            scaler.scale((ddp(inputs) - inputs[:, :8]).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
    except InvalidOptionError as refusal:
        return str(refusal)
    return None


def worker(rank: int, world: int) -> dict:
    del world
    results = each_family_and_name(lambda family, name: train(rank, family, name), extra=(None,))
    results["scaler"] = scaler_found(rank)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=300)


@each_case
def test_a_parameter_of_no_elements_trains_with_every_compressor(runs, family, name):
    if name == "powersgd":  # PyTorch's hook views every gradient as a matrix: refused by name
        assert "'empty' (a parameter of no elements)" in runs[0][(family, name)]["refused"]
        return
    for rank in runs:
        losses = rank[(family, name)]["losses"]
        assert all(math.isfinite(loss) for loss in losses), f"{name}/{family}: {losses}"
    assert torch.equal(runs[0][(family, name)]["parameters"], runs[1][(family, name)]["parameters"])
    if name == "none":
        assert torch.equal(runs[0][(family, name)]["parameters"], runs[0][(family, None)]["parameters"])


def test_the_scaler_is_still_found_past_an_empty_first_parameter(runs):
    for rank in runs:
        assert rank["scaler"] is not None and "divided by 2^8" in rank["scaler"], rank["scaler"]
