"""Shared-mask allreduce: one worker's selection for everyone (after ScaleCom, Chen et al. 2020).

All workers agree on the same positions, so the values fit a plain allreduce and no
worker sends indices but one. Per bucket and step:

1. the *leader* -- worker ``step mod W``, cycling so that every worker's error-feedback
   memory leads in turn (ScaleCom's cyclic local top-k) -- compresses its compensated
   parts with the compressor (SIDCo's threshold, top-k, ...) and broadcasts the ``P``
   part counts (every slot ``-1`` flags a non-finite leader), then the indices;
2. every worker gathers its own compensated values at those positions, and one
   allreduce of ``m / W`` gives the mean there. A non-leader whose input held NaN/Inf
   (checked with one read of its parts, which it does not compress) sends NaN, so every
   rank sees the flag in the reduced values.

Every worker's contribution stands for the leader's positions: error feedback keeps the
rest. With a narrow ``value_dtype`` the allreduce sums in that dtype (as the dense
``bf16`` compressor does), so the sum carries that dtype's rounding. Traffic per worker for ``k`` positions: ``k`` indices broadcast (received once by
every non-leader) plus a ring allreduce of ``k`` values, ``2k (W-1)/W`` -- flat in ``W``.
Step 1 blocks (the values depend on it); the allreduce overlaps backward.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradsift.compressors.base import Payload, index_dtype
from gradsift.errors import InvalidOptionError
from gradsift.exchanges import wire
from gradsift.exchanges.base import Codec, Context, Delivery, Exchange, Part, sparse_entries
from gradsift.exchanges.collectives import Pending, allreduce_sum, blocking, ready, ring_allreduce_received
from gradsift.validation import all_finite


class SharedMask(Exchange):
    """The cyclic leader's positions, broadcast, then one allreduce of values (module docstring)."""

    name = "shared-mask"

    def start(self, parts: list[Part], codec: Codec | None, context: Context) -> Pending[Delivery]:
        if codec is None:
            raise InvalidOptionError("the shared-mask exchange carries sparse payloads only")
        rank, world = dist.get_rank(context.group), context.world
        leader = context.step % world
        device = context.result.device
        if rank == leader:
            encoded = [codec.encode(part, context.record) for part in parts]
            indices = [sparse_entries(e.wire, self.name)[0] for e in encoded]
            nonfinite = any(e.nonfinite for e in encoded)
            header = [-1] * len(parts) if nonfinite else [i.numel() for i in indices]
        else:
            started = time.perf_counter()
            nonfinite = not all(all_finite(part.input) for part in parts)
            context.record.compress_ms += (time.perf_counter() - started) * 1e3
            header, indices = [0] * len(parts), []
        counts = _broadcast(
            torch.tensor(header, dtype=wire.HEADER_DTYPE, device=device), leader, context, "counts broadcast"
        )
        if bool((counts < 0).any()):
            return ready(Delivery(sent=[None] * len(parts), nonfinite=True))
        sizes = counts.tolist()
        wire_index = index_dtype(max(part.numel for part in parts))
        flat = (
            torch.cat(indices).to(wire_index)
            if rank == leader
            else torch.empty(sum(sizes), dtype=wire_index, device=device)
        )
        flat = _broadcast(flat, leader, context, "indices broadcast")
        positions = [chunk.long() for chunk in flat.split(sizes)]
        if rank != leader:
            _validate(positions, parts)
            context.record.compressed_tensors += len(parts)
            context.record.elements_sent += sum(sizes)
        values = torch.cat([part.input[p] for part, p in zip(parts, positions, strict=True)])
        if codec.value_dtype is not None:
            values = values.to(codec.value_dtype)
        message = torch.full_like(values, float("nan")) if nonfinite else torch.div(values, world)
        index_bytes = flat.numel() * flat.element_size() + counts.numel() * counts.element_size()
        value_bytes = message.numel() * message.element_size()
        sent = value_bytes + (index_bytes if rank == leader else 0)
        received = ring_allreduce_received(value_bytes, world) + (0 if rank == leader else index_bytes)
        context.record.add_bytes(sent=sent, padded=sent, received=received)

        def finish(message: torch.Tensor) -> Delivery:
            if not all_finite(message):
                return Delivery(sent=[None] * len(parts), nonfinite=True)
            started = time.perf_counter()
            for part, mean, where in zip(parts, message.split(sizes), positions, strict=True):
                view = part.view(context.result)
                view.zero_()
                view.index_put_((where,), mean.to(view.dtype))
            context.record.decompress_ms += (time.perf_counter() - started) * 1e3
            return Delivery(
                sent=[
                    Payload(numel=part.numel, dtype=part.input.dtype, values=sent, indices=where)
                    for part, sent, where in zip(parts, values.split(sizes), positions, strict=True)
                ]
            )

        return allreduce_sum(message, context.group, "values allreduce").then(finish)


def _broadcast(tensor: torch.Tensor, source: int, context: Context, what: str) -> torch.Tensor:
    """Blocking broadcast from ``source`` (a rank of the group)."""
    root = dist.get_global_rank(context.group, source) if context.group is not None else source
    blocking(what, context.group, lambda: dist.broadcast(tensor, root, group=context.group, async_op=True))
    return tensor


def _validate(positions: list[torch.Tensor], parts: list[Part]) -> None:
    """The leader's positions must lie in each part (a receiver never scatters out of range)."""
    for i, (where, part) in enumerate(zip(positions, parts, strict=True)):
        wire.check_positions(where, part.numel, i)
