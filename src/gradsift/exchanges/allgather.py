"""Allgather of variable-size payloads: every worker receives every other worker's message.

For payloads whose size or positions differ between workers (sparsifiers, VGC, the
quantizers). One message per bucket holds the ``P`` parts' payloads (:mod:`wire`):

1. all_gather the int32 header (``P * F`` field lengths, or the non-finite flag in every
   slot) -- blocking, because the receive buffers are sized from it. If any worker
   flagged, no data follows and every rank reports the same non-finite step;
2. per field, pad the local data to ``max_w len_w(f)`` and ``all_gather_into_tensor``;
3. when the data arrive: trim, validate each worker's message (:func:`wire.decode`),
   and write ``decompress([p_1, ..., p_W])`` of each part into the result.

Bytes: ``bytes_sent`` is the message (data + headers, ``sum(p.nbytes)``), ``bytes_padded``
adds the padding to the longest worker, ``bytes_received`` is ``(W-1)`` times the padded
message (every other worker's slot). Per-worker traffic therefore grows with ``W``.
Steps 1-3 are :func:`gather_payloads`, which the balanced exchange reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsift.compressors.base import Payload
from gradsift.errors import GradsiftError
from gradsift.exchanges import wire
from gradsift.exchanges.base import Codec, Context, Delivery, Exchange, Part, waited
from gradsift.exchanges.collectives import Pending, allgather, ready


@dataclass
class Gathered:
    """Every worker's payloads (``decoded[w][part]``), or why there are none."""

    decoded: list[list[Payload]] | None = None
    nonfinite: bool = False
    error: BaseException | None = None


class Allgather(Exchange):
    """Header allgather, then one padded allgather per field (see the module docstring)."""

    name = "allgather"

    def start(self, parts: list[Part], codec: Codec | None, context: Context) -> Pending[Delivery]:
        if codec is None:
            raise GradsiftError("the allgather exchange carries compressed payloads only")
        encoded = [codec.encode(part, context.record) for part in parts]

        def finish(gathered: Gathered) -> Delivery:
            if gathered.decoded is None:
                return Delivery(sent=[None] * len(parts), nonfinite=gathered.nonfinite, error=gathered.error)
            for i, part in enumerate(parts):
                codec.decompress_into(
                    [d[i] for d in gathered.decoded], part.view(context.result), context.record
                )
            return Delivery(sent=[e.wire for e in encoded])

        return gather_payloads([e.wire for e in encoded], any(e.nonfinite for e in encoded), context).then(
            finish
        )


def gather_payloads(payloads: list[Payload], nonfinite: bool, context: Context) -> Pending[Gathered]:
    """Steps 1-3 of the module docstring for one message of ``payloads`` (wire form).

    Counts the bytes into ``context.record``. The result holds every worker's decoded
    payloads, or ``nonfinite`` when some worker flagged, or the :class:`WireFormatError`
    a malformed message raised.
    """
    fields = len(payloads[0].fields())
    headers = _gather_headers(wire.header(payloads, nonfinite), context)
    if wire.check_headers(headers, len(payloads), fields):
        return ready(Gathered(nonfinite=True))
    data = wire.concat_fields(payloads)
    lengths = headers.view(context.world, len(payloads), fields).sum(dim=1).tolist()
    longest = [max(row[j] for row in lengths) for j in range(fields)]
    padded = headers.shape[1] * headers.element_size() + sum(
        n * t.element_size() for n, t in zip(longest, data.values(), strict=True)
    )
    context.record.add_bytes(
        sent=sum(p.nbytes for p in payloads), padded=padded, received=(context.world - 1) * padded
    )
    buffers, gathers = [], []
    for (name, local), size in zip(data.items(), longest, strict=True):
        slot = torch.zeros(size, dtype=local.dtype, device=local.device)
        slot[: local.numel()] = local
        out = torch.empty(context.world * size, dtype=local.dtype, device=local.device)
        gathers.append(allgather(out, slot, context.group, f"{name} all_gather"))
        buffers.append(out.view(context.world, size))

    def decode(_: list[torch.Tensor]) -> Gathered:
        rows = headers.tolist()
        try:
            return Gathered(
                decoded=[
                    wire.decode(
                        rows[w],
                        {name: buffers[j][w, : lengths[w][j]] for j, name in enumerate(data)},
                        payloads,
                    )
                    for w in range(context.world)
                ]
            )
        except GradsiftError as error:
            return Gathered(error=error)

    return Pending.gather(gathers).then(decode)


def _gather_headers(lengths: list[int], context: Context) -> torch.Tensor:
    """All-gather each worker's header (blocking); return a ``[W, len(lengths)]`` int32 CPU tensor."""
    device = context.result.device
    local = torch.tensor(lengths, dtype=wire.HEADER_DTYPE, device=device)
    out = torch.empty(context.world * len(lengths), dtype=wire.HEADER_DTYPE, device=device)
    waited(context.record, allgather(out, local, context.group, "header all_gather"))
    return out.view(context.world, len(lengths)).cpu()
