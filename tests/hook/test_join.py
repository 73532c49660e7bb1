"""DDP's ``join()`` for uneven inputs, with the hook (``gradsift.hook.auto``'s docstring).

Two real gloo ranks; rank 0 has 9 batches, rank 1 has 5, and both train under ``with
ddp.join():``, so from step 5 rank 1 only shadows DDP's collectives (its hooks run on zero
buckets, it takes no optimizer step). The oracle is stock DDP under the same join in the
same worker: ``auto`` (the default), which under join keeps stock DDP's allreduce and makes
no collective of its own, must train bit for bit as stock DDP does, under SGD with momentum
and under AdamW; a named method must finish on every rank with the ranks' parameters
equal. Before, ``auto``'s agreement after rank 0's optimizer steps met rank 1's shadow
allreduce and gloo aborted the joined rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES = (9, 5)  # per rank
NAMED = {"sgd": ("none", "bf16", "sidco-exp", "topk"), "adamw": ("none", "efsignsgd", "sidco-exp")}


def train(rank: int, family: str, name: str | None, before_join: int = 0) -> dict:
    """``name`` None is stock DDP; the hook's dense warm-up is 2 steps, so a named method
    compresses before rank 1 runs out. ``before_join`` steps run before the join starts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    ddp = DDP(model)
    if family == "sgd":
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    state = None
    if name == "auto":
        state = gradsift.register_comm_hook(ddp)
    elif name is not None:
        state = gradsift.register_comm_hook(ddp, name, warmup_steps=2)

    def one_step(step: int) -> None:
        inputs = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        (ddp(inputs) - inputs[:, :8]).square().mean().backward()
        optimizer.step()

    for step in range(before_join):
        one_step(step)
    with ddp.join():
        for step in range(before_join, BATCHES[rank]):
            one_step(step)
    return {
        "parameters": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "auto": state.stats()["auto"] if name == "auto" else None,
        "momentum": optimizer.param_groups[0].get("momentum"),
    }


def worker(rank: int, world: int) -> dict:
    del world
    results = {}
    for family, named in NAMED.items():
        for name in (None, "auto", *named):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a run's warnings are not what this test judges
                results[(family, name)] = train(rank, family, name)
    results["sgd", "auto", "joined at 3"] = train(rank, "sgd", "auto", before_join=3)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=300)


@pytest.mark.parametrize("family", list(NAMED))
def test_auto_under_join_trains_as_stock_ddp(runs, family):
    for rank in runs:
        stock, auto = rank[(family, None)], rank[(family, "auto")]
        assert torch.equal(auto["parameters"], stock["parameters"])  # bit for bit
        assert auto["auto"]["choice"] == "none" and auto["auto"]["running"] == "none"
        assert auto["auto"]["decided_at"] == 0  # join was on from the first step
    assert torch.equal(runs[0][(family, None)]["parameters"], runs[1][(family, None)]["parameters"])


@pytest.mark.parametrize(("family", "name"), [(f, n) for f, names in NAMED.items() for n in names])
def test_a_named_method_finishes_under_join_with_the_ranks_equal(runs, family, name):
    ours, other = runs[0][(family, name)]["parameters"], runs[1][(family, name)]["parameters"]
    assert torch.isfinite(ours).all() and torch.equal(ours, other)


def test_auto_measuring_when_join_starts_leaves_its_start_method_for_stock_ddp(runs):
    """Under SGD ``auto`` measures on ``sidco-exp`` (its momentum correction holds SGD's
    momentum); a join from step 3 ends the measuring there, the momentum handed back."""
    for rank in runs:
        auto = rank["sgd", "auto", "joined at 3"]["auto"]
        assert auto["measured_on"] == "sidco-exp"
        assert (auto["choice"], auto["running"], auto["decided_at"]) == ("none", "none", 3)
        assert rank["sgd", "auto", "joined at 3"]["momentum"] == 0.9  # SGD's own again
    ours, other = (rank["sgd", "auto", "joined at 3"]["parameters"] for rank in runs)
    assert torch.isfinite(ours).all() and torch.equal(ours, other)
