"""``DistributedDataParallel(..., gradient_as_bucket_view=True)``: every compressor, bit for bit.

With ``gradient_as_bucket_view=True`` each parameter's ``.grad`` is a view of its bucket's
memory, the memory the hook reads and into which some methods write state until the step's
close (error feedback's new velocity, :mod:`gradsift.hook.feedback`). The oracle is the same
run without it: for every registry name, under SGD with momentum and under AdamW, past the
dense warm-up (``warmup_steps=2``; PowerSGD's ``start_iter=2``), on 2 real gloo ranks with
several buckets, the parameters after the run are equal to the bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("sgd", "adamw")
OPTIONS = {"threshold": {"threshold": 0.01}, "powersgd": {"start_iter": 2}}


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
    if family == "sgd":
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gradsift.register_comm_hook(ddp, name, warmup_steps=2, **OPTIONS.get(name, {}))
    for step in range(6):
        inputs = torch.randn(32, 20, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(inputs), torch.arange(32) % 4).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def worker(rank: int, world: int) -> dict:
    del world
    results = {}
    for family in FAMILIES:
        for name in gradsift.available_compressors():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a run's warnings are not what this test judges
                results[family, name] = [train(rank, family, name, as_view) for as_view in (False, True)]
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", gradsift.available_compressors())
def test_gradients_as_bucket_views_train_as_copies(runs, family, name):
    for rank in runs:
        copies, views = rank[family, name]
        assert torch.isfinite(copies).all() and torch.equal(copies, views)
