"""Balanced sparse reduce-scatter + allgather (after Ok-Topk, Li and Hoefler 2022).

Sparse payloads (``indices``, ``values``) of all of a bucket's parts, in bucket
coordinates. Every worker owns one slice ``[b_r, b_{r+1})`` of the bucket's index space.
Let ``K`` be the sum of the parts' capacities and ``c = ceil(SLACK K / W)`` the room of
one slice in one message:

1. each worker sorts its entries by position and sends, to every worker ``r``, one
   fixed-size block: a flag word (non-finite input), the number of its entries in
   slice ``r`` it sends (at most ``c``: a slice's further entries wait in error
   feedback), and their positions and values at capacity ``c`` -- one
   ``all_to_all_single`` of equal blocks, with no size exchange before it;
2. worker ``r`` checks the blocks it received (counts within ``c``, positions inside
   its slice and increasing), sums the entries per position (the slice's reduced
   gradient, at most ``W c`` positions) and re-sparsifies it to
   ``k_r = round(mean_w count_w)`` entries (at most ``c``), the largest in magnitude
   (exact selection: the received entries are few, where the exact top-k is the
   cheapest and best estimate), so the result stays ``K``-sparse;
3. the reduced slices are allgathered (:func:`allgather.gather_payloads`); every worker
   writes the mean ``(1/W) sum`` of the surviving entries into its result.

What this worker sent at a position that did not survive, and what it could not send,
stays in its error-feedback residual (its contribution stands for its delivered
entries only), so every rank's ``sum of contributions - what error feedback keeps`` is
exactly what was delivered.

Load balance: the slice bounds are the ``W``-quantiles of the previous step's surviving
positions (the same on every rank: everyone received them), kept per bucket in the
state store (``balanced.bounds``); the first step cuts the index space evenly. Positions
are *canonical* (the bucket's parameters in number order,
:class:`~gradsift.core.store.Canonical`), so the slices do not move when DDP rebuilds its
buckets or a resumed run starts from DDP's initial layout.

Traffic per worker, ``K`` entries of ``e`` bytes: ``(W-1) c`` entries received in step 1
and ``(W-1) c`` in step 3 -- ``2 SLACK K (W-1)/W``, flat in ``W`` -- against ``(W-1) K``
for the allgather exchange. Step 1 waits for its collective (step 2 needs the data; on
NCCL a stream dependency, not a host wait); step 3's transfer overlaps backward. No
host read.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist

from gradsift.core import wire
from gradsift.core.collectives import Pending, blocking
from gradsift.core.errors import InvalidOptionError
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload, index_dtype
from gradsift.core.store import Canonical
from gradsift.exchanges.allgather import gather_payloads
from gradsift.exchanges.base import Codec, Encoded, Exchange

BOUNDS = "balanced.bounds"

#: Room of one slice in one block, as a multiple of an even share ``K / W`` of the entries.
SLACK = 1.5

_LAST = torch.iinfo(torch.int64).max


class Balanced(Exchange):
    """Sparse reduce-scatter by owned slices, re-sparsified, then allgathered (module docstring)."""

    name = "balanced"
    exact = False  # the summed slices are re-sparsified to k entries (step 2)
    copies_input = True

    def __init__(self) -> None:
        self._canonical: dict[tuple[int, ...], Canonical] = {}

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        if len(parts) > 1 and all(isinstance(part.key, tuple) for part in parts):
            # A bucket cut into the buckets of a saved state (a resumed first step,
            # gradsift.hook.layout.saved_runs): each is sliced as the bucket it was.
            trips = [
                self._start_bucket([own], codec, own_context)
                for own, own_context in _as_buckets(parts, context)
            ]
            return Pending.gather(trips).then(Outcome.joined)
        return self._start_bucket(parts, codec, context)

    def _start_bucket(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        """Steps 1-3 of the module docstring on one bucket's parts."""
        encoded = [codec.encode(part, context) for part in parts]
        world, numel, device = context.world, context.result.numel(), context.result.device
        room = math.ceil(SLACK * sum(_sparse(e.wire)[0].numel() for e in encoded) / world)
        canonical = self._canonical_of(context)
        positions, values, delivered_at = _bucket_entries(parts, encoded, canonical, numel)
        bounds = _bounds(context, numel, device)
        flags = [e.wire.nonfinite for e in encoded if e.wire.nonfinite is not None]
        nonfinite = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)
        blocks, sent_counts, shipped = _blocks(positions, values, bounds, room, world, nonfinite, numel)
        received = torch.empty_like(blocks)
        blocking(
            "entries all_to_all",
            context.group,
            lambda: dist.all_to_all_single(received, blocks, group=context.group, async_op=True),
        )
        got = _unpack_blocks(received, world, room, values.dtype, numel)
        mine = bounds[context.rank], bounds[context.rank + 1]
        malformed_blocks = _check_blocks(got, mine, room)
        entry = values.element_size() + index_dtype(numel).itemsize
        block_nbytes = received.numel() // world
        context.record.add_bytes(
            sent=sent_counts.sum() * entry + 2 * world * wire.HEADER_DTYPE.itemsize,
            padded=blocks.numel(),
            received=(world - 1) * block_nbytes,
        )
        survivors = _reduce_slice(got, room, numel, context.result.dtype)
        survivors.nonfinite = got.flags.any() | nonfinite

        def finish(gathered: wire.Received) -> Outcome:
            with context.record.timed("decompress_ms", device):
                kept, summed = _all_survivors(gathered)
                result = context.result
                for part in parts:
                    part.view(result).zero_()
                valid = kept < numel
                flat = canonical.flat_positions(torch.where(valid, kept, 0))
                result.index_add_(0, flat, torch.where(valid, summed, 0).to(result.dtype) / world)
                survived = torch.sort(kept).values
                context.store.put(BOUNDS, context.key, _balanced_bounds(survived, numel, world))
                sent = [
                    _delivered(e, positions.index_select(0, at), shipped.index_select(0, at), survived)
                    for e, at in zip(encoded, delivered_at, strict=True)
                ]
            return Outcome.of(
                parts,
                list(sent),
                nonfinite=gathered.nonfinite,
                malformed=gathered.malformed | malformed_blocks,
            )

        return gather_payloads([survivors], context)[1].then(finish)

    def _canonical_of(self, context: Context) -> Canonical:
        order = tuple(context.order)
        if order not in self._canonical:
            self._canonical[order] = Canonical(order, context.numels)
        return self._canonical[order]


def _as_buckets(parts: list[Part], context: Context) -> list[tuple[Part, Context]]:
    """Each part of a cut bucket as a bucket of its own: the part at offset 0 of its own
    result (the bucket result's slice), keyed and laid out as its saved bucket was."""
    buckets = []
    for part in parts:
        members = set(cast(tuple, part.key))
        own = replace(part, offset=0)
        order = tuple(number for number in context.order if number in members)
        buckets.append((own, replace(context, result=part.view(context.result), key=part.key, order=order)))
    return buckets


class _Blocks:
    """The blocks one worker received: per sender the flag, the count, positions and values."""

    def __init__(
        self, flags: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor, values: torch.Tensor
    ):
        self.flags, self.counts, self.positions, self.values = flags, counts, positions, values


def _sparse(payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
    if payload.indices is None or payload.values is None:
        raise InvalidOptionError("the balanced exchange carries (indices, values) payloads only")
    return payload.indices, payload.values


def _bucket_entries(
    parts: list[Part], encoded: list[Encoded], canonical: Canonical, numel: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """All parts' entries in use at canonical positions, sorted by position (entries not in
    use last, at position ``numel``), their values, and per part where its entries went
    in the sorted order."""
    positions, values = [], []
    for part, e in zip(parts, encoded, strict=True):
        indices, sent = _sparse(e.wire)
        used = torch.arange(indices.numel(), device=indices.device) < e.wire.entries()
        at = canonical.canonical_positions(indices.long() + part.offset)
        positions.append(torch.where(used, at, numel))
        values.append(torch.where(used, sent, 0))
    joined = torch.cat(positions)
    ordered, order = torch.sort(joined, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    sizes = [p.numel() for p in positions]
    return ordered, torch.cat(values).index_select(0, order), list(rank.split(sizes))


def _even_bounds(numel: int, world: int, device: torch.device) -> torch.Tensor:
    return torch.div(torch.arange(world + 1, device=device) * numel, world, rounding_mode="floor")


def _bounds(context: Context, numel: int, device: torch.device) -> torch.Tensor:
    """This bucket's slice bounds: last step's balanced ones, or an even cut."""
    stored = context.store.get(BOUNDS, context.key)
    if stored is not None and stored.numel() == context.world + 1:
        return stored.to(device)
    return _even_bounds(numel, context.world, device)


def _blocks(
    positions: torch.Tensor,
    values: torch.Tensor,
    bounds: torch.Tensor,
    room: int,
    world: int,
    nonfinite: torch.Tensor,
    numel: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``W`` send blocks (uint8 ``[W, block]``), how many entries go to each slice, and
    which sorted entries were shipped (the first ``room`` of each slice)."""
    device = positions.device
    valid = positions < numel
    slices = torch.bucketize(positions, bounds[1:-1], right=True).clamp_max(world - 1)
    starts = torch.searchsorted(positions, bounds[:-1])
    rank_in_slice = torch.arange(positions.numel(), device=device) - starts.index_select(0, slices)
    shipped = valid & (rank_in_slice < room)
    slots = torch.where(shipped, slices * room + rank_in_slice, world * room)  # the last slot is a bin
    wire_index = index_dtype(numel)
    sent_positions = torch.zeros(world * room + 1, dtype=wire_index, device=device)
    sent_positions.index_copy_(0, slots, positions.to(wire_index))
    sent_values = torch.zeros(world * room + 1, dtype=values.dtype, device=device)
    sent_values.index_copy_(0, slots, values)
    counts = torch.zeros(world, dtype=torch.int64, device=device)
    counts.index_add_(0, slices, shipped.long())
    header = torch.stack([nonfinite.long().expand(world), counts], dim=1).to(wire.HEADER_DTYPE)
    block = torch.cat(
        [
            header.view(torch.uint8).view(world, -1),
            _aligned_bytes(sent_positions[:-1].view(world, room)),
            _aligned_bytes(sent_values[:-1].view(world, room)),
        ],
        dim=1,
    )
    return block.contiguous(), counts, shipped


def _aligned_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``[W, m]`` rows as ``[W, bytes]`` uint8, padded to 8 bytes per row."""
    raw = rows.contiguous().view(torch.uint8).view(rows.shape[0], -1)
    pad = -raw.shape[1] % 8
    return raw if pad == 0 else torch.cat([raw, raw.new_zeros(raw.shape[0], pad)], dim=1)


def _unpack_blocks(received: torch.Tensor, world: int, room: int, dtype: torch.dtype, numel: int) -> _Blocks:
    rows = received.view(world, -1)
    header = rows[:, :8].view(wire.HEADER_DTYPE).long()
    offset = 8
    wire_index = index_dtype(numel)
    index_nbytes = room * wire_index.itemsize
    positions = rows[:, offset : offset + index_nbytes].view(wire_index).long()
    offset += index_nbytes + (-index_nbytes % 8)
    values = rows[:, offset : offset + room * dtype.itemsize].view(dtype)
    return _Blocks(header[:, 0] != 0, header[:, 1], positions, values)


def _check_blocks(got: _Blocks, mine: tuple[torch.Tensor, torch.Tensor], room: int) -> torch.Tensor:
    """``[W]`` malformed flags of the received blocks; entries not in use or outside this
    worker's slice are zeroed in place (position at the slice start, value 0)."""
    used = torch.arange(room, device=got.positions.device).unsqueeze(0) < got.counts.unsqueeze(1)
    inside = (got.positions >= mine[0]) & (got.positions < mine[1])
    bad = (got.counts < 0) | (got.counts > room) | (used & ~inside).any(dim=1)
    if room > 1:
        bad |= (used[:, 1:] & (got.positions[:, 1:] <= got.positions[:, :-1])).any(dim=1)
    keep = used & inside
    got.positions = torch.where(keep, got.positions, _LAST)
    got.values = torch.where(keep, got.values, 0)
    return bad


def _reduce_slice(got: _Blocks, room: int, numel: int, dtype: torch.dtype) -> Payload:
    """Sum the received entries per position and keep the ``k_r`` largest magnitudes.

    The sums travel on in the gradient's ``dtype``, whatever ``value_dtype`` the entries
    came in: rounding a sum would be an error no worker's feedback keeps.
    """
    world = got.positions.shape[0]
    positions = got.positions.reshape(-1)
    ordered, order = torch.sort(positions)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    group = torch.cumsum(first.long(), 0) - 1
    # Each worker's positions are distinct (the entries not in use sit at _LAST with value
    # 0), so adding one worker's block at a time sums every position in rank order.
    groups = torch.empty_like(group).index_copy_(0, order, group).view(world, room)
    values = got.values.to(dtype)
    summed = torch.zeros(positions.numel(), dtype=dtype, device=positions.device)
    for rank in range(world):
        summed.index_add_(0, groups[rank], values[rank])
    unique = torch.full_like(ordered, _LAST).index_copy_(0, group, ordered)  # equal within a group
    real = unique < _LAST
    keep = torch.round(got.counts.clamp(0, room).double().mean()).long()
    magnitudes = torch.where(real, summed.abs(), -1)
    top = torch.topk(magnitudes, min(room, magnitudes.numel()), sorted=True)
    chosen = torch.arange(top.indices.numel(), device=ordered.device) < torch.minimum(keep, real.sum())
    kept_positions = torch.where(chosen, unique.index_select(0, top.indices), _LAST)
    kept_positions, by_position = torch.sort(kept_positions)
    kept_values = torch.where(chosen, summed.index_select(0, top.indices), 0).index_select(0, by_position)
    length = chosen.sum()
    in_use = torch.arange(kept_positions.numel(), device=ordered.device) < length
    return Payload(
        numel=numel,
        dtype=dtype,
        values=kept_values,
        indices=torch.where(in_use, kept_positions, 0).to(index_dtype(numel)),
        length=length,
    )


def _all_survivors(gathered: wire.Received) -> tuple[torch.Tensor, torch.Tensor]:
    """Every worker's surviving (canonical) positions -- entries not in use at ``_LAST``,
    sorted last -- and their summed values."""
    positions, values = [], []
    for (payload,) in gathered.payloads:
        assert payload.indices is not None and payload.values is not None
        used = torch.arange(payload.indices.numel(), device=payload.indices.device) < payload.entries()
        positions.append(torch.where(used, payload.indices.long(), _LAST))
        values.append(payload.values)
    return torch.cat(positions), torch.cat(values)


def _balanced_bounds(survived: torch.Tensor, numel: int, world: int) -> torch.Tensor:
    """Bounds putting an equal share of the surviving positions (``survived``: sorted, the
    entries not in use last) in every slice; an even cut when fewer survived than there
    are workers."""
    even = _even_bounds(numel, world, survived.device)
    if world == 1 or survived.numel() == 0:
        return even
    total = (survived < numel).sum()
    cuts = torch.div(torch.arange(1, world, device=survived.device) * total, world, rounding_mode="floor")
    inner = survived.index_select(0, cuts.clamp_max(survived.numel() - 1))
    balanced = torch.cat([even[:1], inner, even[-1:]])
    return torch.where(total >= world, balanced, even)


def _delivered(
    encoded: Encoded, positions: torch.Tensor, shipped: torch.Tensor, survived: torch.Tensor
) -> Payload:
    """The part's sent entries (at canonical ``positions``) that were shipped in step 1 and
    survived; the rest stays in the residual (its value here is 0, so error feedback
    subtracts nothing for it)."""
    indices, values = _sparse(encoded.wire)
    found = torch.searchsorted(survived, positions).clamp_max(survived.numel() - 1)
    delivered = shipped & (survived.index_select(0, found) == positions)
    return Payload(
        numel=encoded.wire.numel,
        dtype=encoded.payload.dtype,
        values=torch.where(delivered, values, 0),
        indices=indices,
        length=encoded.wire.length,
    )
