"""Which worker a per-worker state belongs to: its rank and world size, checked when loaded.

Under plain DDP the model's and the optimizer's states are the same on every rank, so the
usual checkpoint is written by rank 0 alone and read by every rank. The states gradsift adds
are each worker's own: the hook's error-feedback residuals (what this worker has not sent
yet) and generators, DeMo's and Distributed Lion's momenta. Rank 0's file holds rank 0's
only, and every rank that loaded it would go on from rank 0's residuals -- the workers' sum
of unsent gradient becomes ``W`` copies of one worker's -- without an error, and the resumed
run would differ from the uninterrupted one.

:func:`worker_stamp` records ``{"rank": r, "world_size": W}`` in such a state;
:func:`check_worker` refuses a state stamped by another rank or another world size, naming
what was saved and how to save every rank's. A state without a stamp (a checkpoint older
than it) loads as before.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradsift.core.errors import InvalidOptionError


def worker_stamp(group: Any = None) -> dict[str, int]:
    """This worker's rank and the world size of ``group`` (rank 0 of 1 without torch.distributed)."""
    if not dist.is_initialized():
        return {"rank": 0, "world_size": 1}
    return {"rank": dist.get_rank(group), "world_size": dist.get_world_size(group)}


def check_worker(saved: Any, group: Any, what: str, how: str) -> None:
    """Raise :class:`InvalidOptionError` unless ``saved`` (a :func:`worker_stamp`, or None for a
    state older than the stamp) is this worker's in ``group``; ``what`` names the state and its
    per-worker part, ``how`` the way to save every rank's."""
    if saved is None:
        return
    if (
        not isinstance(saved, dict)
        or set(saved) != {"rank", "world_size"}
        or not all(type(value) is int and value >= 0 for value in saved.values())
    ):
        raise InvalidOptionError(
            f"{what}: the saved worker must be {{'rank': int, 'world_size': int}}, got {saved!r}"
        )
    ours = worker_stamp(group)
    if saved != ours:
        raise InvalidOptionError(
            f"{what} was saved by rank {saved['rank']} of {saved['world_size']}, and rank {ours['rank']} "
            f"of {ours['world_size']} loads it: each worker's is its own, so a checkpoint written by one "
            f"rank holds that rank's only; {how}"
        )
