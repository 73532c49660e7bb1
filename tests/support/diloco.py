"""What the DiLoCo tests share: an inner step on the shared problem, and a round a peer dies in."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

import gradsift
from gradsift.core.errors import PeerFailureError
from support.models import batch, flat_params, make_model

INNER_LR = 0.05


def inner(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One inner step of ``rank`` on the shared regression problem (``support.models.batch``)."""
    x, y = batch(rank, step)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def trained(
    diloco: Callable[[torch.nn.Module, torch.optim.Optimizer], Any],
    rank: int,
    steps: int,
    sync_every: int,
    *,
    adamw: bool = False,
    resume_at: int | None = None,
) -> tuple[list[torch.Tensor], Any]:
    """``steps`` inner steps of a fresh model under ``diloco(model, optimizer)``: the
    parameters after every round and the final state. With ``resume_at``, before that step
    the model, the inner optimizer and the state are saved, rebuilt and restored."""

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = make_model()
        optimizer = (torch.optim.AdamW if adamw else torch.optim.SGD)(model.parameters(), lr=INNER_LR)
        return model, optimizer, diloco(model, optimizer)

    model, optimizer, state = fresh()
    rounds = []
    for step in range(steps):
        if step == resume_at:
            saved = (model.state_dict(), optimizer.state_dict(), state.state_dict())
            state.detach()
            model, optimizer, state = fresh()
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
        inner(model, optimizer, rank, step)
        if (step + 1) % sync_every == 0:
            rounds.append(flat_params(model))
    return rounds, state


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
