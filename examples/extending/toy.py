"""The small problem both extending examples train, and their two-process launcher.

A two-layer network regresses ``sin(x . w)`` for a fixed ``w`` on Gaussian inputs; each
rank draws its own batch at each step (seeded by rank and step, so a run repeats
exactly). :func:`spawn` starts ``WORLD`` processes on this machine, joins them in a gloo
group and prints what the given function returns on rank 0, as one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

WORLD, STEPS, LR = 2, 8, 0.1
FEATURES, HIDDEN, BATCH = 8, 32, 32


def make_model() -> torch.nn.Module:
    """The same network on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs at ``step`` and their targets."""
    teacher = torch.linspace(-1.0, 1.0, FEATURES)
    inputs = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(1000 * step + rank))
    return inputs, torch.sin(inputs @ teacher).unsqueeze(1)


def sgd(model: torch.nn.Module, rank: int, steps: int = STEPS) -> list[float]:
    """``steps`` steps of plain SGD (learning rate ``LR``) on this rank's batches; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = batch(rank, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def spawn(run: Callable[[int], dict[str, Any]]) -> None:
    """Run ``run(rank)`` on ``WORLD`` gloo processes of this machine; print rank 0's result."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_process, args=(run, port), nprocs=WORLD)


def _process(rank: int, run: Callable[[int], dict[str, Any]], port: int) -> None:
    torch.set_num_threads(1)  # WORLD processes share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = run(rank)
        if rank == 0:
            print(json.dumps(result))
    finally:
        dist.destroy_process_group()
