"""``DistributedDataParallel(..., gradient_as_bucket_view=True)``: every compressor, bit for bit.

With ``gradient_as_bucket_view=True`` each parameter's ``.grad`` is a view of its bucket's
memory, the memory the hook reads and into which some methods write state until the step's
close (error feedback's new velocity, :mod:`gradsift.hook.feedback`). The oracle is the same
run without it: for every registry name, under SGD with momentum and under AdamW, past the
dense warm-up (``warmup_steps=2``; PowerSGD's ``start_iter=2``), on 2 real gloo ranks with
several buckets, the parameters after the run are equal to the bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.every_compressor import OPTIONS, each_case, each_family_and_name, optimizer_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def train(rank: int, family: str, name: str, as_view: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 4),
    )
    ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=0.02)  # several buckets
    optimizer = optimizer_for(family, ddp.parameters())
    gradsift.register_comm_hook(ddp, name, warmup_steps=2, **OPTIONS.get(name, {}))
    for step in range(6):
        inputs = torch.randn(32, 20, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(inputs), torch.arange(32) % 4).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def worker(rank: int, world: int) -> dict:
    del world
    return each_family_and_name(
        lambda family, name: [train(rank, family, name, view) for view in (False, True)]
    )


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=300)


@each_case
def test_gradients_as_bucket_views_train_as_copies(runs, family, name):
    for rank in runs:
        copies, views = rank[family, name]
        assert torch.isfinite(copies).all() and torch.equal(copies, views)
