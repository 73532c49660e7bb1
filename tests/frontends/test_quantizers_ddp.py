"""Every registry name through ``gradsift.register_comm_hook`` on 2 real gloo ranks.

The cross-cutting check: one worker launch trains a tiny regression MLP with each
compressor in turn and reports, per name, the losses, the final parameters and the
hook's byte counts. Each name then has its own test: no error, bit-identical
parameters on both ranks, a loss that decreases, and no more bytes than dense.
"""

import inspect
from pathlib import Path

import pytest
import torch

import gradsift
from gradsift.compressors.registry import compressor_class

NAMES = gradsift.available_compressors()
WORLD = 2
STEPS = 30

#: Options that make each method do real work within STEPS steps of a ~700-parameter model.
OVERRIDES = {
    "threshold": {"threshold": 0.05},
    "powersgd": {"start_iter": 2},
}


def options_for(name: str) -> dict:
    """10% density for sparsifiers (1% of a tiny model is a handful of elements)."""
    if name in OVERRIDES:
        return OVERRIDES[name]
    accepts_ratio = "ratio" in inspect.signature(compressor_class(name)).parameters
    return {"ratio": 0.1} if accepts_ratio else {}


def train_every_compressor(rank: int, world_size: int, names: list[str]) -> dict:
    """Worker: train with each name; return per name the losses/params or the error text."""
    from torch.nn.parallel import DistributedDataParallel

    gen = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(64, 20, generator=gen)
    targets = inputs @ torch.linspace(-1, 1, 20).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=gen)
    results = {}
    for name in names:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            ddp = DistributedDataParallel(model)
            state = gradsift.register_comm_hook(ddp, name, **options_for(name))
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
            losses = []
            for _ in range(STEPS):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            with torch.no_grad():
                final = torch.nn.functional.mse_loss(model(inputs), targets).item()
            totals = state.stats()["total"]
            results[name] = {
                "losses": losses,
                "final": final,
                "params": [p.detach().clone() for p in model.parameters()],
                "bytes_sent": totals["bytes_sent"],
                "dense_bytes": totals["dense_bytes"],
            }
        except Exception as error:  # reported per name by the tests below
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results


@pytest.fixture(scope="module")
def runs():
    from support.distributed import run_workers

    return run_workers(Path(__file__), "train_every_compressor", WORLD, timeout=240, names=NAMES)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_compressor_trains_through_the_ddp_hook(name, runs):
    per_rank = [result[name] for result in runs]
    for result in per_rank:
        assert "error" not in result, result.get("error")
    # Identical parameters on every rank, bit for bit.
    for mine, other in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        assert torch.equal(mine, other)
    # The loss decreases: the mean final loss over both ranks' data is below 80% of the initial one.
    initial = sum(r["losses"][0] for r in per_rank) / WORLD
    final = sum(r["final"] for r in per_rank) / WORLD
    assert final < 0.8 * initial, (initial, final)
    # Compression never sends more than the dense gradient (``none`` sends exactly that).
    for result in per_rank:
        assert 0 < result["bytes_sent"] <= result["dense_bytes"]
        if name == "none":
            assert result["bytes_sent"] == result["dense_bytes"]
