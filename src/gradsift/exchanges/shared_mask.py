"""Shared-mask allreduce: one worker's selection for everyone (after ScaleCom, Chen et al. 2020).

All workers agree on the same positions, so the values fit a plain allreduce and no
worker sends indices but one. Per bucket and step:

1. the *leader* -- worker ``step mod W``, cycling so that every worker's error-feedback
   memory leads in turn (ScaleCom's cyclic local top-k) -- compresses its compensated
   parts with the compressor (SIDCo's threshold, top-k, ...) into fixed-capacity
   payloads and broadcasts one int32 message: its header (the non-finite flag, per part
   the entries in use and the entries wanted) and the parts' positions at capacity;
2. every worker gathers its own compensated values at those positions (0 at padding),
   and one allreduce of ``m / W`` gives the mean there. A non-leader whose input held
   NaN/Inf (checked on the device with one sum of its parts, which it does not
   compress) adds NaN to its message, so every rank sees the flag in the reduced values.

Every worker's contribution stands for the leader's positions: error feedback keeps the
rest. Non-leaders check the leader's positions on the device (entries in use within
the part, strictly increasing); a malformed message is decoded into nothing and flagged.
With a narrow ``value_dtype`` the allreduce sums in that dtype (as the dense ``bf16``
compressor does), so the sum carries that dtype's rounding. Traffic per worker for
capacity ``k``: ``k`` indices broadcast (received once by every non-leader) plus a ring
allreduce of ``k`` values, ``2k (W-1)/W`` -- flat in ``W``. Step 1 waits for the
broadcast (the values depend on it; on NCCL that is a stream dependency, not a host
wait); the allreduce overlaps backward. No host read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsift.compressors.base import in_use
from gradsift.core import wire
from gradsift.core.collectives import Pending, allreduce_sum, blocking, ring_allreduce_received
from gradsift.core.errors import InvalidOptionError
from gradsift.core.finite import nonfinite
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload, index_dtype
from gradsift.exchanges.allgather import sum_counts
from gradsift.exchanges.base import Codec, Exchange


class SharedMask(Exchange):
    """The cyclic leader's positions, broadcast, then one allreduce of values (module docstring)."""

    name = "shared-mask"
    exact = False  # every worker's values at the leader's positions only

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        world, leader = context.world, context.step % context.world
        leading = context.rank == leader
        capacities = [_capacity(part, context) for part in parts]
        header_words = 1 + 2 * len(parts)
        wire_index = index_dtype(max(part.numel for part in parts))
        device = context.result.device
        message = torch.zeros(header_words + sum(capacities), dtype=torch.int64, device=device)
        if leading:
            encoded = [codec.encode(part, context) for part in parts]
            flags = [e.wire.nonfinite for e in encoded if e.wire.nonfinite is not None]
            if flags:
                message[0:1].copy_(torch.stack(flags).any().reshape(1))
            for i, e in enumerate(encoded):
                wire.put_count(message, 1 + 2 * i, e.wire.entries())
                wire.put_count(
                    message, 2 + 2 * i, e.wire.entries() if e.wire.demand is None else e.wire.demand
                )
            indices = torch.cat([_sparse(e.wire)[0] for e in encoded])
            message[header_words:].copy_(indices)
            local_nonfinite = None
        else:
            with context.record.timed("compress_ms", device):
                local_nonfinite = nonfinite(*(part.input for part in parts))
        flat = message.to(wire_index) if wire_index == torch.int32 else message
        blocking(
            "positions broadcast",
            context.group,
            lambda: dist.broadcast(flat, _global_rank(context, leader), group=context.group, async_op=True),
        )
        header = flat[:header_words].long()
        lengths, demands = header[1::2], header[2::2]
        positions, used, malformed = _checked_positions(
            flat[header_words:].long(), lengths, capacities, parts
        )
        if not leading:
            context.record.add("compressed_tensors", len(parts))
            context.record.add("elements_sent", lengths.clamp_min(0).sum())
        gathered = [
            torch.where(valid, part.input.index_select(0, where), 0)
            for part, where, valid in zip(parts, positions, used, strict=True)
        ]
        values = torch.cat(gathered)
        if codec.value_dtype is not None:
            values = values.to(codec.value_dtype)
        message_values = torch.div(values, world)
        if local_nonfinite is not None:
            message_values = message_values + torch.where(local_nonfinite, float("nan"), 0.0)
        leader_flag = (header[0] & wire.NONFINITE) != 0
        _count_bytes(context, leading, flat, lengths, capacities, message_values, wire_index, world)

        def finish(mean: torch.Tensor) -> Outcome:
            with context.record.timed("decompress_ms", device):
                for part, share, where in zip(parts, mean.split(capacities), positions, strict=True):
                    view = part.view(context.result)
                    view.zero_()
                    view.index_add_(0, where, share.to(view.dtype))
            flagged = leader_flag | nonfinite(mean)
            sent = [
                Payload(numel=part.numel, dtype=part.input.dtype, values=own, indices=where, length=length)
                for part, own, where, length in zip(
                    parts, values.split(capacities), positions, lengths, strict=True
                )
            ]
            flags = torch.zeros(world, dtype=torch.bool, device=device)
            flags[leader : leader + 1] = malformed
            in_use = lengths.clamp_min(0)  # every worker sends at the leader's positions (beyond: malformed)
            return Outcome.of(parts, list(sent), nonfinite=flagged, malformed=flags, demand=(demands, in_use))

        return allreduce_sum(message_values, context.group, "values allreduce").then(finish)


def _capacity(part: Part, context: Context) -> int:
    capacity = context.capacities.get(part.key)
    if capacity is None:
        raise InvalidOptionError("the shared-mask exchange carries sparse payloads only")
    return capacity


def _sparse(payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
    if payload.indices is None or payload.values is None:
        raise InvalidOptionError("the shared-mask exchange carries (indices, values) payloads only")
    return payload.indices, payload.values


def _checked_positions(
    flat: torch.Tensor, lengths: torch.Tensor, capacities: list[int], parts: list[Part]
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per part the leader's positions (entries not in use, or out of range: 0), which are in
    use, and whether the leader's message was malformed (0-d bool)."""
    positions, used, bad = [], [], []
    for chunk, length, capacity, part in zip(flat.split(capacities), lengths, capacities, parts, strict=True):
        valid = in_use(capacity, length, chunk.device)
        valid = torch.ones_like(chunk, dtype=torch.bool) if valid is None else valid
        inside = (chunk >= 0) & (chunk < part.numel)
        increasing = (valid[1:] & (chunk[1:] <= chunk[:-1])).any() if capacity > 1 else inside.new_zeros(())
        bad.append((length < 0) | (length > capacity) | (valid & ~inside).any() | increasing)
        keep = valid & inside
        positions.append(torch.where(keep, chunk, 0))
        used.append(keep)
    return positions, used, torch.stack(bad).any().reshape(1)


def _count_bytes(
    context: Context,
    leading: bool,
    flat: torch.Tensor,
    lengths: torch.Tensor,
    capacities: list[int],
    values: torch.Tensor,
    wire_index: torch.dtype,
    world: int,
) -> None:
    """Bytes of the broadcast (sent by the leader, received by the others) and of the values
    allreduce; entries in use for ``sent``, the capacity for ``padded``."""
    header_nbytes = (flat.numel() - sum(capacities)) * flat.element_size()
    used_entries = lengths.clamp(0).sum()
    index_used = used_entries * wire_index.itemsize + header_nbytes
    index_padded = flat.numel() * flat.element_size()
    value_padded = values.numel() * values.element_size()
    value_used = used_entries * values.element_size()
    context.record.add_bytes(
        sent=sum_counts([value_used, index_used]) if leading else value_used,
        padded=value_padded + (index_padded if leading else 0),
        received=ring_allreduce_received(value_padded, world) + (0 if leading else index_padded),
    )


def _global_rank(context: Context, rank: int) -> int:
    return dist.get_global_rank(context.group, rank) if context.group is not None else rank
