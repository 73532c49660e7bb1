"""Collectives: the variable-size sparse exchange and the plain allreduce.

Neither function knows which compressor produced the tensors. Both are device
agnostic (gloo on CPU, NCCL on GPU) and return ``torch.futures.Future`` objects so the
DDP hook overlaps communication with the rest of backward.

Sparse exchange of one message (``W`` workers, fields ``f``):

1. all_gather the int32 header (field lengths, or the non-finite flag) -- blocking,
   because the receive buffers are sized from it;
2. per field: pad the local data to ``max_w len_w(f)``, one ``all_gather_into_tensor``;
3. trim worker ``w``'s slice back to ``len_w(f)`` (in the future's callback).

Any failure of a collective (a peer that died, a timeout) is re-raised as
:class:`~gradsift.errors.PeerFailureError` with the rank and the backend's message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradsift.errors import PeerFailureError
from gradsift.wire import HEADER_DTYPE

T = TypeVar("T")

Gathered = dict[str, list[torch.Tensor]]

# torch >= 2.13 renames all_gather_into_tensor (same signature) and deprecates the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def gather_headers(lengths: list[int], device: torch.device, group: Any) -> torch.Tensor:
    """All-gather each worker's header; return a ``[W, len(lengths)]`` int32 CPU tensor."""
    world = dist.get_world_size(group)
    local = torch.tensor(lengths, dtype=HEADER_DTYPE, device=device)
    out = torch.empty(world * len(lengths), dtype=HEADER_DTYPE, device=device)
    guarded("header all_gather", group, lambda: _all_gather(out, local, group=group))
    return out.view(world, len(lengths)).cpu()


def gather_fields(
    data: Mapping[str, torch.Tensor], lengths: torch.Tensor, group: Any
) -> torch.futures.Future[Gathered]:
    """All-gather variable-length fields; the future holds, per field, each worker's trimmed tensor.

    ``lengths[w, j]`` is worker ``w``'s length of the ``j``-th field of ``data`` (in
    ``data``'s order). One ``all_gather_into_tensor`` per field, padded to the largest.
    """
    world = lengths.shape[0]
    names = list(data)
    per_field = lengths.tolist()
    works, buffers = [], []
    for j, name in enumerate(names):
        local = data[name]
        longest = max(row[j] for row in per_field)
        padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        out = torch.empty(world * longest, dtype=local.dtype, device=local.device)
        work = guarded(
            f"{name} all_gather",
            group,
            lambda out=out, padded=padded: _all_gather(out, padded, group=group, async_op=True),
        )
        works.append(work.get_future())
        buffers.append(out.view(world, longest))

    def trim(done: torch.futures.Future[Any]) -> Gathered:
        for fut in done.value():
            fut.value()  # re-raises a failed gather
        return {
            name: [buffers[j][w, : per_field[w][j]] for w in range(world)] for j, name in enumerate(names)
        }

    return torch.futures.collect_all(works).then(trim)


def allreduce_mean(
    tensor: torch.Tensor, group: Any, *, in_place: bool = False
) -> torch.futures.Future[torch.Tensor]:
    """Mean over workers by ``allreduce(tensor / W)`` (the division first, as stock DDP does).

    With ``in_place`` the division and the sum happen in ``tensor`` itself (stock DDP's
    own hook does this to the bucket buffer; it saves a copy); otherwise ``tensor`` is
    not modified. The future holds the mean in ``tensor``'s dtype.
    """
    world = dist.get_world_size(group)
    buffer = tensor.div_(world) if in_place else torch.div(tensor, world)
    work = guarded("allreduce", group, lambda: dist.all_reduce(buffer, group=group, async_op=True))
    return work.get_future().then(lambda fut: fut.value()[0])
