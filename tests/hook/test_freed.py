"""A hook state goes when the script lets go of its model, optimizer and scaler.

DDP's reducer holds the hook's state from C++, where Python's garbage collector cannot see the
reference: a state that referred back to its DDP model made a cycle no collection breaks, so the
model, its optimizer, its scaler and every buffer of the hook stayed alive for the rest of the
process (``compressor="auto"`` did). The oracle is :mod:`weakref`: after ``del`` and
``gc.collect()`` nothing of a run remains, for the one line and for a named method, on 2 real gloo
ranks; and a second run in the same process finds its own ``GradScaler`` (discovery adopts the one
scaler alive; the first run's, kept, made two and was refused at the first step).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def run(rank: int, compressor: str) -> list[weakref.ref]:
    """Three steps under a ``GradScaler`` the hook finds; weak references to what the run built."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state = gradsift.register_comm_hook(ddp, compressor)
    generator = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            inputs = torch.randn(8, 16, generator=generator)
            optimizer.zero_grad()
            scaler.scale((ddp(inputs) - inputs[:, :4]).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
    return [weakref.ref(thing) for thing in (state, ddp, optimizer, scaler)]


def worker(rank: int, world: int) -> dict:
    del world
    alive = {}
    for compressor in ("auto", "topk", "auto"):  # the second auto run: a scaler of its own to find
        refs = run(rank, compressor)
        gc.collect()
        alive.setdefault(compressor, []).append([ref() is not None for ref in refs])
    return alive


def test_nothing_of_a_run_outlives_it():
    for alive in run_workers(__file__, "worker", 2):
        assert alive == {"auto": [[False] * 4, [False] * 4], "topk": [[False] * 4]}, alive
