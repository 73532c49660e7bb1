"""DDP on a process subgroup: the hook follows ``ddp_model.process_group``.

Four real gloo ranks in two data-parallel groups, ``[0, 1]`` and ``[2, 3]`` (as beside tensor or
pipeline parallelism), each training its own replicas on its own data. Under SGD with momentum
and under AdamW: ``none`` trains bit for bit as stock DDP on the same subgroup; ``auto`` (its
agreements and probes on the subgroup) and named methods past their warm-up keep each group's
replicas equal, and the two groups apart.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.every_compressor import FAMILIES, optimizer_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NAMES = (None, "none", "auto", "sidco-exp", "efsignsgd")


def train(rank: int, group, family: str, name: str | None) -> torch.Tensor:
    """``name`` None is stock DDP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = DDP(model, process_group=group)
    optimizer = optimizer_for(family, ddp.parameters())
    if name == "auto":
        gradsift.register_comm_hook(ddp)
    elif name is not None:
        gradsift.register_comm_hook(ddp, name, warmup_steps=2)
    for step in range(10):
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        (ddp(inputs) - inputs[:, :4]).square().mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def worker(rank: int, world: int) -> dict:
    del world
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    results = {}
    for family in FAMILIES:
        for name in NAMES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a run's warnings are not what this test judges
                results[family, name] = train(rank, groups[rank // 2], family, name)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 4, timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", NAMES[1:])
def test_each_group_keeps_its_replicas_equal(runs, family, name):
    ranks = [rank[family, name] for rank in runs]
    assert all(torch.isfinite(params).all() for params in ranks)
    assert torch.equal(ranks[0], ranks[1]) and torch.equal(ranks[2], ranks[3])
    assert not torch.equal(ranks[0], ranks[2])
    if name == "none":
        assert all(torch.equal(rank[family, name], rank[family, None]) for rank in runs)  # stock DDP's
