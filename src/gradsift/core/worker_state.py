"""Which worker a per-worker state belongs to: its rank and world size, checked when loaded.

Under plain DDP the model's and the optimizer's states are the same on every rank, so the
usual checkpoint is written by rank 0 alone and read by every rank. The states gradsift adds
are each worker's own: the hook's error-feedback residuals (what this worker has not sent
yet) and generators, DeMo's and Distributed Lion's momenta. Rank 0's file holds rank 0's
only, and every rank that loaded it would go on from rank 0's residuals -- the workers' sum
of unsent gradient becomes ``W`` copies of one worker's -- without an error, and the resumed
run would differ from the uninterrupted one.

:func:`worker_stamp` records ``{"rank": r, "world_size": W}`` of the state's process group
and the process's own in the default group, ``{"global_rank": R, "global_world_size": P}``:
under FSDP2's hybrid sharding the hook's group is the replicate dimension, and the ``S``
processes of one shard group share a replicate rank while each holds its own shard's
residuals (of the same shapes, as FSDP2 shards evenly), so the group's rank alone cannot tell
them apart. :func:`check_worker` refuses a state stamped by another rank or another world
size, naming what was saved and how to save every rank's. A state without a stamp (a
checkpoint older than it) loads as before, and one stamped with the group's two numbers only
is checked on those.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradsift.core.errors import InvalidOptionError


def worker_stamp(group: Any = None) -> dict[str, int]:
    """This worker's rank and the world size of ``group``, and the process's in the default
    group (rank 0 of 1 each without torch.distributed)."""
    if not dist.is_initialized():
        return {"rank": 0, "world_size": 1, "global_rank": 0, "global_world_size": 1}
    return {
        "rank": dist.get_rank(group),
        "world_size": dist.get_world_size(group),
        "global_rank": dist.get_rank(),
        "global_world_size": dist.get_world_size(),
    }


#: The keys of a stamp written before the process's own numbers were recorded.
GROUP_KEYS = {"rank", "world_size"}


def check_worker(saved: Any, group: Any, what: str, how: str) -> None:
    """Raise :class:`InvalidOptionError` unless ``saved`` (a :func:`worker_stamp`, one of the
    group's two numbers only, or None for a state older than the stamp) is this worker's in
    ``group``; ``what`` names the state and its per-worker part, ``how`` the way to save every
    rank's."""
    if saved is None:
        return
    if (
        not isinstance(saved, dict)
        or set(saved) not in (GROUP_KEYS, set(worker_stamp()))
        or not all(type(value) is int and value >= 0 for value in saved.values())
    ):
        raise InvalidOptionError(
            f"{what}: the saved worker must be {{'rank': int, 'world_size': int, 'global_rank': int, "
            f"'global_world_size': int}}, got {saved!r}"
        )
    ours = {key: value for key, value in worker_stamp(group).items() if key in saved}
    if saved != ours:
        raise InvalidOptionError(
            f"{what} was saved by {_worker(saved)}, and {_worker(ours)} loads it: each worker's is its "
            f"own, so a checkpoint written by one rank holds that rank's only; {how}"
        )


def _worker(stamp: dict[str, int]) -> str:
    named = f"rank {stamp['rank']} of {stamp['world_size']}"
    if "global_rank" in stamp:
        named += f" (process {stamp['global_rank']} of {stamp['global_world_size']})"
    return named
