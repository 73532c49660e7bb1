"""What the DiLoCo tests share: an inner step on the shared problem, and a round a peer dies in."""

from __future__ import annotations

import os
import time

import torch

import gradsift
from gradsift.core.errors import PeerFailureError
from support.models import batch, make_model

INNER_LR = 0.05


def inner(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One inner step of ``rank`` on the shared regression problem (``support.models.batch``)."""
    x, y = batch(rank, step)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def dying_worker(rank: int, world: int, sync_every: int = 3, adamw: bool = False, **diloco: object) -> dict:
    """One full round, then rank 1 exits (status 3) and the others start the next round: what
    each survivor saw (its ``PeerFailureError`` and how long it took to come)."""
    model = make_model()
    optimizer_class = torch.optim.AdamW if adamw else torch.optim.SGD
    optimizer = optimizer_class(model.parameters(), lr=INNER_LR)
    gradsift.diloco(model, optimizer, sync_every=sync_every, **diloco)
    for step in range(sync_every):
        inner(model, optimizer, rank, step)
    if rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        for step in range(sync_every, 2 * sync_every):
            inner(model, optimizer, rank, step)
    except PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def survivors_raised(results: list, world: int) -> bool:
    """Every rank but the dead one (1) raised within 20 s."""
    survivors = [r for rank, r in enumerate(results) if rank != 1]
    return len(survivors) == world - 1 and all(
        r["error"] is not None and r["seconds"] < 20 for r in survivors
    )
