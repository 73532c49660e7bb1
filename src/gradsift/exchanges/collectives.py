"""torch.distributed calls shared by the exchanges: failure wrapping, ready futures, volumes.

Every collective an exchange starts goes through :func:`guarded` (a backend error
becomes :class:`~gradsift.errors.PeerFailureError` naming the rank and the backend's
message) and returns a ``torch.futures.Future`` so that the DDP hook overlaps
communication with the rest of backward. Nothing here knows a compressor.

Byte volumes (what arrives at one worker's NIC, ``W`` workers, ``S`` bytes per worker
message) are those of the bandwidth-optimal algorithms: ring allreduce
``2 (W-1)/W S``, allgather ``(W-1) S``, broadcast ``S`` (to every non-root).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradsift.errors import PeerFailureError

T = TypeVar("T")

# torch >= 2.13 renames all_gather_into_tensor (same signature) and deprecates the old name.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def peer_failure(error: BaseException, group: Any, what: str) -> PeerFailureError:
    """Wrap a backend error of collective ``what`` into a :class:`PeerFailureError`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return PeerFailureError(
        f"{what} failed on rank {rank} of {world}: a peer process is gone, stalled past the "
        f"process group's timeout, or sent something else ({type(error).__name__}: {error})"
    )


def guarded(what: str, group: Any, call: Callable[[], T]) -> T:
    """Run ``call()``; turn a backend error into a :class:`PeerFailureError`."""
    try:
        return call()
    except RuntimeError as error:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, ...)
        raise peer_failure(error, group, what) from error


def ready(value: T) -> torch.futures.Future[T]:
    """A future that is already complete with ``value``."""
    future: torch.futures.Future[T] = torch.futures.Future()
    future.set_result(value)
    return future


def allreduce_sum(tensor: torch.Tensor, group: Any, what: str = "allreduce") -> torch.futures.Future[Any]:
    """Start an in-place sum of ``tensor`` over the group; the future completes when it is done."""
    work = guarded(what, group, lambda: dist.all_reduce(tensor, group=group, async_op=True))
    return work.get_future()


def allgather(out: torch.Tensor, local: torch.Tensor, group: Any, what: str) -> torch.futures.Future[Any]:
    """Start ``all_gather_into_tensor(out, local)``; ``out`` holds ``W`` copies' worth of ``local``."""
    work = guarded(what, group, lambda: all_gather_into(out, local, group=group, async_op=True))
    return work.get_future()


def ring_allreduce_received(nbytes: int, world: int) -> int:
    """Bytes one worker receives in a ring allreduce of an ``nbytes`` message: ``2 (W-1)/W nbytes``."""
    return 2 * (world - 1) * nbytes // world
