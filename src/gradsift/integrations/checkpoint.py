"""Checkpoint the hook's state of every rank in one file, and check replicas before saving.

The hook's state is *per rank*: each worker keeps its own error-feedback residuals
(what it has not sent yet), compressor adaptation state and RNG stream, while model and
optimizer states are replicated. The usual pattern -- rank 0 writes one checkpoint --
therefore needs every rank's hook state gathered to rank 0 (:func:`gather_hook_states`,
a collective) and, on resume, each rank picking its own entry (:func:`load_hook_state`).
Resuming on a different number of workers is refused: residuals belong to a rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsift.errors import InvalidOptionError
from gradsift.exchanges.collectives import blocking


def gather_hook_states(state: Any, group: Any = None, dst: int = 0) -> dict[str, Any] | None:
    """Collective: rank ``dst`` (of ``group``) receives ``{"world_size": W, "ranks": [sd_0, ..., sd_{W-1}]}``.

    ``sd_r`` is rank r's ``state.state_dict()``; every other rank gets ``None``. Every rank
    of ``group`` must call this (it is a ``gather_object``).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered: list[Any] | None = [None] * world if rank == dst else None
    dist.gather_object(state.state_dict(), gathered, group=group, group_dst=dst)
    return None if gathered is None else {"world_size": world, "ranks": gathered}


def load_hook_state(state: Any, saved: dict[str, Any], group: Any = None) -> None:
    """Restore this rank's entry of :func:`gather_hook_states`' result into ``state``."""
    if not isinstance(saved, dict) or "ranks" not in saved or "world_size" not in saved:
        raise InvalidOptionError(
            "saved must be the dict gather_hook_states returned (keys world_size, ranks)"
        )
    check_same_world_size(saved["world_size"], group)
    state.load_state_dict(saved["ranks"][dist.get_rank(group)])


def check_same_world_size(saved_world_size: int, group: Any = None) -> None:
    """Refuse a hook state saved by a run of another size: residuals belong to a rank."""
    world = dist.get_world_size(group)
    if saved_world_size != world:
        raise InvalidOptionError(
            f"checkpoint holds the hook state of {saved_world_size} ranks, this run has world_size={world}; "
            "error-feedback residuals belong to a rank, so resume with the same number of workers"
        )


def parameters_agree(module: torch.nn.Module, group: Any = None) -> bool:
    """Collective: True when every rank holds bit-identical parameters.

    Compares a float64 digest ``(sum p, sum i*p_i, sum p^2)`` of the flattened
    parameters across ranks (one small all_gather), so a diverged replica -- e.g. after
    an optimizer step on unsynchronised gradients -- is caught before it is saved.
    """
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in module.parameters()])
    positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    digest = torch.stack([flat.sum(), (flat * positions).sum(), flat.square().sum()])
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    blocking("digest all_gather", group, lambda: dist.all_gather(digests, digest, group=group, async_op=True))
    return all(torch.equal(d, digests[0]) for d in digests)
