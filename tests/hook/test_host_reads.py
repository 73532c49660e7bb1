"""The DDP hook's host reads per training step, held to a budget (issue: sync-free on CUDA).

Every host read of a device tensor stalls a GPU and serialises communication with
backward (tests/support/host_reads.py lists what counts). Stock DDP makes none. gradsift's hook
makes none during backward (the step closes on the device) and at most :data:`BUDGET` per
step in all -- the one read of the step's checks when it settles, at the optimizer's step
(flags, counts, telemetry) -- and :data:`BALANCED_BUDGET` for the balanced exchange; the
count must not grow with the number of buckets or workers.

Measured with real gloo processes at 2 and 4 ranks, with a model in 1 and in 3 DDP
buckets, for every registry compressor through every exchange it supports.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.host_reads import HostReads

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BUDGET = 1
BALANCED_BUDGET = 4
STEPS, COUNTED = 4, 2  # the last COUNTED steps are counted (DDP rebuilds its buckets after step 1)
WIDTH, BATCH = 160, 16  # three 160x160 layers of 103 kB each


#: SIDCo's statistical path (its buckets here are below the exact top-k's crossover).
FITTED = ("sidco-exp/fit", "sidco-gpareto/fit", "sidco-gamma/fit")


def combinations() -> list[tuple[str, str]]:
    """Every (compressor, exchange) the registry allows, SIDCo on both of its paths."""
    pairs = []
    for name in [*gradsift.available_compressors(), *FITTED]:
        for exchange in _build(name).exchanges:
            pairs.append((name, exchange))
    return pairs


def _build(name: str) -> gradsift.Compressor:
    options = {"threshold": {"threshold": 0.01}, "powersgd": {"start_iter": 2}}.get(name, {})
    if name in FITTED:
        return gradsift.get_compressor(name.split("/")[0], exact_below=0)
    return gradsift.get_compressor(name, **options)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)]
    return torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2])


def _bucket_cap_mb(buckets: int) -> float:
    """3 buckets (one per layer: DDP closes a bucket once it reaches the cap, a little below
    one weight matrix) or 1 (a cap above the whole model)."""
    weight = WIDTH * WIDTH * 4 / 2**20
    return weight * 0.99 if buckets == 3 else weight * 4


def reads_per_step(rank: int, world: int, compressor: str, exchange: str, buckets: int) -> dict:
    model = DDP(_model(), bucket_cap_mb=_bucket_cap_mb(buckets))
    if compressor != "stock":
        gradsift.register_comm_hook(model, _build(compressor), exchange=exchange)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = (torch.randn(BATCH, WIDTH, generator=generator) for _ in range(2))
    counts, in_backward, sites = [], [], {}
    for step in range(STEPS):
        reads, backward_reads = HostReads(), HostReads()
        with reads:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            with backward_reads:
                loss.backward()
            optimizer.step()
        if step >= STEPS - COUNTED:
            counts.append(reads.count)
            in_backward.append(backward_reads.count)
            sites.update(reads.sites)
    return {
        "counts": counts,
        "in_backward": in_backward,
        "sites": sites,
        "buckets": model._get_ddp_logging_data().get("num_buckets_reduced"),
    }


def all_worker(rank: int, world: int, buckets: int, pairs: list) -> dict:
    return {pair: reads_per_step(rank, world, *pair, buckets) for pair in pairs}


@pytest.fixture(scope="module", params=[(2, 1), (2, 3), (4, 3)], ids=lambda p: f"{p[0]}ranks-{p[1]}buckets")
def measured(request) -> dict:
    world, buckets = request.param
    pairs = [("stock", "none"), *combinations()]
    return run_workers(__file__, "all_worker", world, timeout=600, buckets=buckets, pairs=pairs)[0]


def test_stock_ddp_reads_nothing(measured):
    assert measured[("stock", "none")]["counts"] == [0] * COUNTED


@pytest.mark.parametrize("pair", combinations(), ids=lambda p: f"{p[0]}-{p[1]}")
def test_host_reads_per_step_within_budget(pair, measured):
    budget = BALANCED_BUDGET if pair[1] == "balanced" else BUDGET
    result = measured[pair]
    worst = max(result["counts"])
    top = sorted(result["sites"].items(), key=lambda item: -item[1])[:12]
    assert worst <= budget, f"{pair}: {result['counts']} host reads per step (budget {budget}); sites: {top}"
    assert result["in_backward"] == [0] * COUNTED, f"{pair}: host reads during backward; sites: {top}"


def test_the_counter_counts_host_data_written_onto_the_device():
    """What a GPU would copy from the host, counted on CPU; what it would not, not counted."""
    target, source = torch.zeros(4), torch.ones(1)
    copies = {
        "a host int written": lambda: target.__setitem__(1, 3),
        "a host float written": lambda: target.__setitem__(slice(0, 2), 2.5),
        "new_tensor": lambda: target.new_tensor([1.0]),
        "as_tensor onto a device": lambda: torch.as_tensor([1.0], device=target.device),
        "tensor onto a device": lambda: torch.tensor([1.0], device=target.device),
    }
    kernels = {
        "a number as a kernel argument": lambda: target[1:2].fill_(3),
        "a device tensor written": lambda: target.__setitem__(slice(0, 1), source),
        "as_tensor of a tensor": lambda: torch.as_tensor(source, device=target.device),
        "a host tensor made on the host": lambda: torch.tensor([1.0], device="cpu"),
    }
    for name, action in {**copies, **kernels}.items():
        with HostReads() as reads:
            action()
        assert reads.count == (1 if name in copies else 0), name
