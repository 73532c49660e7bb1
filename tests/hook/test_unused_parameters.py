"""Every compressor under ``find_unused_parameters=True``, with a layer no step uses.

DDP with ``find_unused_parameters=True`` (the Hugging Face ``Trainer``'s default for a model
without gradient checkpointing) marks a parameter that did not take part in the forward pass
ready with a zero gradient, runs the hook on its bucket as on any other, and leaves the
``.grad`` of a parameter no rank used untouched (``None`` after ``zero_grad``). The oracle
is stock DDP in the same worker: for every registry name, under SGD with momentum and under
AdamW, on 2 real gloo ranks, past the dense warm-up (``warmup_steps=2``; PowerSGD's
``start_iter=2``), every step's loss is finite, the unused layer ends as stock DDP leaves
it (untouched, no gradient), and the ranks hold the same parameters. PowerSGD with PyTorch's
``orthogonalization_epsilon=0`` at rank 1 shows what the check catches: the unused layer's
all-zero matrix is 0/0 at the first compressed step (Gram-Schmidt's normalisation).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.every_compressor import OPTIONS, each_case, each_family_and_name, optimizer_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6


class WithUnusedHead(torch.nn.Module):
    """A body and a head every step uses, and a head none does (as an unused pooler)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 8)
        self.unused = torch.nn.Linear(64, 16)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(inputs)))


def train(rank: int, family: str, name: str | None, options: dict) -> dict:
    """``name`` None is stock DDP."""
    model = WithUnusedHead()
    unused_before = [p.detach().clone() for p in model.unused.parameters()]
    ddp = DDP(model, find_unused_parameters=True)
    if name is not None:
        gradsift.register_comm_hook(ddp, name, warmup_steps=2, **OPTIONS.get(name, {}), **options)
    optimizer = optimizer_for(family, ddp.parameters())
    losses = []
    for step in range(STEPS):
        inputs = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        loss = (ddp(inputs) - inputs[:, :8]).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "unused_untouched": all(
            torch.equal(p, q) for p, q in zip(model.unused.parameters(), unused_before, strict=True)
        ),
        "unused_grads": [p.grad for p in model.unused.parameters()],
        "parameters": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def worker(rank: int, world: int) -> dict:
    del world
    results = each_family_and_name(lambda family, name: train(rank, family, name, {}), extra=(None,))
    # rank 1: PyTorch orthogonalises by Gram-Schmidt up to rank 2 (and in half precision), by QR above
    results["epsilon 0"] = train(rank, "sgd", "powersgd", {"orthogonalization_epsilon": 0.0, "rank": 1})
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=300)


@each_case
def test_a_layer_no_step_uses_stays_as_stock_ddp_leaves_it(runs, family, name):
    stock = runs[0][(family, None)]
    assert stock["unused_untouched"] and stock["unused_grads"] == [None, None]  # DDP's own rule
    for rank in runs:
        run = rank[(family, name)]
        assert all(math.isfinite(loss) for loss in run["losses"]), f"{name}/{family}: {run['losses']}"
        assert run["unused_untouched"] and run["unused_grads"] == [None, None]
    assert torch.equal(runs[0][(family, name)]["parameters"], runs[1][(family, name)]["parameters"])


def test_powersgd_with_pytorchs_epsilon_is_what_the_check_catches(runs):
    losses = runs[0]["epsilon 0"]["losses"]
    assert all(math.isfinite(loss) for loss in losses[:3]) and not math.isfinite(losses[-1])
