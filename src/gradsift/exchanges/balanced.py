"""Balanced sparse reduce-scatter + allgather (after Ok-Topk, Li and Hoefler 2022).

Sparse payloads (``indices``, ``values``) of all of a bucket's parts, in bucket
coordinates. Every worker owns one slice ``[b_r, b_{r+1})`` of the bucket's index space:

1. each worker splits its ``k`` entries by slice; one ``all_to_all`` of the ``W`` counts
   (``-1`` in every slot flags a non-finite input), one ``all_to_all`` of the entries:
   worker ``r`` receives every worker's entries of its slice;
2. worker ``r`` sums them (the slice's reduced gradient, at most ``sum_w k_{w,r}``
   positions) and re-sparsifies it to ``k_r = round(mean_w k_{w,r})`` entries, the
   largest in magnitude (exact selection: the ``~k`` received entries are few, where the
   exact top-k is the cheapest and best estimate), so the result stays ``k``-sparse;
3. the reduced slices are allgathered (:func:`allgather.gather_payloads`); every worker
   writes the mean ``(1/W) sum`` of the surviving entries into its result.

What this worker sent at a position that did not survive stays in its error-feedback
residual (its contribution stands for the surviving positions only), so every rank's
``sum of contributions - what error feedback keeps`` is exactly what was delivered.

Load balance: the slice bounds are the ``W``-quantiles of the previous step's surviving
positions (the same on every rank: everyone received them), kept per bucket in the
state store (``balanced.bounds``); the first step cuts the index space evenly. Positions
are *canonical* (the bucket's parameters in number order, :class:`Canonical`), so the
slices do not move when DDP rebuilds its buckets or a resumed run starts from DDP's
initial layout.

Traffic per worker, ``k`` entries of ``e`` bytes: about ``k (W-1)/W`` entries received in
step 1 and ``k (W-1)/W`` in step 3 when the slices are balanced -- ``2k(W-1)/W``, flat in
``W`` -- against ``(W-1) k`` for the allgather exchange. Steps 1 and 2 run on the
autograd thread (the second collective's sizes come from the first, and collectives must
be issued in the same order on every rank); step 3's data transfer overlaps backward.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from gradsift.compressors.base import Payload, index_dtype
from gradsift.errors import InvalidOptionError
from gradsift.exchanges import wire
from gradsift.exchanges.allgather import Gathered, gather_payloads
from gradsift.exchanges.base import Codec, Context, Delivery, Encoded, Exchange, Part, sparse_entries
from gradsift.exchanges.collectives import Pending, blocking, ready

BOUNDS = "balanced.bounds"


class Balanced(Exchange):
    """Sparse reduce-scatter by owned slices, re-sparsified, then allgathered (module docstring)."""

    name = "balanced"

    def start(self, parts: list[Part], codec: Codec | None, context: Context) -> Pending[Delivery]:
        if codec is None:
            raise InvalidOptionError("the balanced exchange carries sparse payloads only")
        encoded = [codec.encode(part, context.record) for part in parts]
        world, numel = context.world, context.result.numel()
        canonical = Canonical(context.order, context.numels, context.result.device)
        positions, values = _bucket_entries(parts, encoded, canonical)
        bounds = _bounds(context, numel, positions.device)
        counts = torch.bincount(torch.bucketize(positions, bounds[1:-1], right=True), minlength=world)
        nonfinite = any(e.nonfinite for e in encoded)
        received_counts = _exchange_counts(counts, nonfinite, context)
        if bool((received_counts < 0).any()):
            return ready(Delivery(sent=[None] * len(parts), nonfinite=True))
        wire_index = index_dtype(numel)
        got_positions = _all_to_all(
            positions.to(wire_index), counts, received_counts, context, "indices all_to_all"
        )
        got_values = _all_to_all(values, counts, received_counts, context, "values all_to_all")
        entry = values.element_size() + wire_index.itemsize
        others = int(received_counts.sum() - received_counts[dist.get_rank(context.group)])
        sent = int(counts.sum()) * entry + world * received_counts.element_size()
        received = others * entry + (world - 1) * received_counts.element_size()
        context.record.add_bytes(sent=sent, padded=sent, received=received)
        keep = int(torch.round(received_counts.double().mean()).item())
        survivors = _reduce_slice(got_positions.long(), got_values, keep, numel, context.result.dtype)
        template = wire.to_wire(survivors)

        def finish(gathered: Gathered) -> Delivery:
            if gathered.decoded is None:
                return Delivery(sent=[None] * len(parts), nonfinite=gathered.nonfinite, error=gathered.error)
            started = time.perf_counter()
            entries = [sparse_entries(d[0], self.name) for d in gathered.decoded]
            kept = torch.cat([indices.long() for indices, _ in entries])
            summed = torch.cat([values for _, values in entries])
            context.store.put(BOUNDS, context.key, _balanced_bounds(kept, numel, world))
            dense = torch.zeros(numel, dtype=context.result.dtype, device=context.result.device)
            dense.index_put_((canonical.to_flat(kept),), summed.to(dense.dtype) / world)
            for part in parts:
                part.view(context.result).copy_(part.view(dense))
            context.record.decompress_ms += (time.perf_counter() - started) * 1e3
            return Delivery(
                sent=[_delivered(part, e, kept, canonical) for part, e in zip(parts, encoded, strict=True)]
            )

        return gather_payloads([template], False, context).then(finish)


class Canonical:
    """Bucket positions <-> canonical positions (the bucket's parameters in number order).

    Slices, their bounds and every position on the wire are canonical, so they do not
    depend on the order DDP lays parameters out in its bucket (which changes when DDP
    rebuilds its buckets, and between a run and its resumed continuation).
    """

    def __init__(self, order: Sequence[int], numels: Mapping[int, int], device: torch.device) -> None:
        sizes = torch.tensor([numels[i] for i in order], dtype=torch.long, device=device)
        by_number = sorted(range(len(order)), key=lambda j: order[j])
        self.identity = by_number == list(range(len(order)))
        self.flat_starts = torch.cumsum(sizes, 0) - sizes
        sorted_sizes = sizes[by_number]
        self.sorted_starts = torch.cumsum(sorted_sizes, 0) - sorted_sizes
        self.canonical_starts = torch.empty_like(self.flat_starts)
        self.canonical_starts[by_number] = self.sorted_starts
        self.sorted_flat_starts = self.flat_starts[by_number]

    def to_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return flat
        chunk = torch.searchsorted(self.flat_starts, flat, right=True) - 1
        return self.canonical_starts[chunk] + flat - self.flat_starts[chunk]

    def to_flat(self, canonical: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return canonical
        chunk = torch.searchsorted(self.sorted_starts, canonical, right=True) - 1
        return self.sorted_flat_starts[chunk] + canonical - self.sorted_starts[chunk]


def _bucket_entries(
    parts: list[Part], encoded: list[Encoded], canonical: Canonical
) -> tuple[torch.Tensor, torch.Tensor]:
    """All parts' sent entries at canonical positions, sorted by position."""
    entries = [sparse_entries(e.wire, Balanced.name) for e in encoded]
    flat = torch.cat(
        [indices.long() + part.offset for part, (indices, _) in zip(parts, entries, strict=True)]
    )
    values = torch.cat([values for _, values in entries])
    if canonical.identity:
        return flat, values
    positions, order = torch.sort(canonical.to_canonical(flat))
    return positions, values[order]


def _even_bounds(numel: int, world: int, device: torch.device) -> torch.Tensor:
    return torch.div(torch.arange(world + 1, device=device) * numel, world, rounding_mode="floor")


def _bounds(context: Context, numel: int, device: torch.device) -> torch.Tensor:
    """This bucket's slice bounds: last step's balanced ones, or an even cut."""
    stored = context.store.get(BOUNDS, context.key)
    if stored is not None and stored.numel() == context.world + 1 and int(stored[-1]) == numel:
        return stored.to(device)
    return _even_bounds(numel, context.world, device)


def _balanced_bounds(kept: torch.Tensor, numel: int, world: int) -> torch.Tensor:
    """Bounds putting an equal share of ``kept`` (sorted positions) in every slice."""
    if kept.numel() < world:
        return _even_bounds(numel, world, kept.device)
    cuts = kept[
        torch.div(torch.arange(1, world, device=kept.device) * kept.numel(), world, rounding_mode="floor")
    ]
    ends = kept.new_tensor([0]), kept.new_tensor([numel])
    return torch.cat([ends[0], cuts, ends[1]])


def _exchange_counts(counts: torch.Tensor, nonfinite: bool, context: Context) -> torch.Tensor:
    """Blocking all_to_all of the per-slice counts; every slot ``-1`` flags a non-finite sender."""
    local = torch.full_like(counts, -1) if nonfinite else counts.clone()
    received = torch.empty_like(local)
    blocking(
        "counts all_to_all",
        context.group,
        lambda: dist.all_to_all_single(received, local, group=context.group, async_op=True),
    )
    return received


def _all_to_all(
    tensor: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, context: Context, what: str
) -> torch.Tensor:
    out = torch.empty(int(received.sum()), dtype=tensor.dtype, device=tensor.device)
    blocking(
        what,
        context.group,
        lambda: dist.all_to_all_single(
            out,
            tensor,
            output_split_sizes=received.tolist(),
            input_split_sizes=counts.tolist(),
            group=context.group,
            async_op=True,
        ),
    )
    return out


def _reduce_slice(
    positions: torch.Tensor, values: torch.Tensor, keep: int, numel: int, dtype: torch.dtype
) -> Payload:
    """Sum the received entries per position and keep the ``keep`` largest magnitudes.

    The sums travel on in the gradient's ``dtype``, whatever ``value_dtype`` the entries
    came in: rounding a sum would be an error no worker's feedback keeps.
    """
    unique, inverse = torch.unique(positions, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=dtype, device=values.device)
    summed.index_add_(0, inverse, values.to(dtype))
    if keep < unique.numel():
        top = torch.topk(summed.abs(), keep, sorted=False).indices.sort().values
        unique, summed = unique[top], summed[top]
    return Payload(numel=numel, dtype=dtype, values=summed, indices=unique)


def _delivered(part: Part, encoded: Encoded, kept: torch.Tensor, canonical: Canonical) -> Payload:
    """The part's sent entries whose (canonical) positions survived; the rest stays in the residual."""
    indices, values = sparse_entries(encoded.wire, Balanced.name)
    local = indices.long()
    survived = torch.isin(canonical.to_canonical(local + part.offset), kept)
    return Payload(
        numel=part.numel, dtype=encoded.payload.dtype, values=values[survived], indices=local[survived]
    )
