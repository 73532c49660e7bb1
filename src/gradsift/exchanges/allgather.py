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
"""

from __future__ import annotations

from typing import Any

import torch

from gradsift.errors import GradsiftError
from gradsift.exchanges import wire
from gradsift.exchanges.base import Codec, Context, Delivery, Exchange, Part
from gradsift.exchanges.collectives import all_gather_into, allgather, guarded, ready


class Allgather(Exchange):
    """Header allgather, then one padded allgather per field (see the module docstring)."""

    name = "allgather"

    def start(
        self, parts: list[Part], codec: Codec | None, context: Context
    ) -> torch.futures.Future[Delivery]:
        if codec is None:
            raise GradsiftError("the allgather exchange carries compressed payloads only")
        encoded = [codec.encode(part, context.record) for part in parts]
        payloads = [e.wire for e in encoded]
        fields = len(payloads[0].fields())
        headers = _gather_headers(wire.header(payloads, any(e.nonfinite for e in encoded)), context)
        if wire.check_headers(headers, len(payloads), fields):
            return ready(Delivery(sent=[None] * len(parts), nonfinite=True))
        data = wire.concat_fields(payloads)
        lengths = headers.view(context.world, len(payloads), fields).sum(dim=1).tolist()
        longest = [max(row[j] for row in lengths) for j in range(fields)]
        padded = headers.shape[1] * headers.element_size() + sum(
            n * t.element_size() for n, t in zip(longest, data.values(), strict=True)
        )
        context.record.add_bytes(
            sent=sum(p.nbytes for p in payloads), padded=padded, received=(context.world - 1) * padded
        )
        buffers, futures = [], []
        for (name, local), size in zip(data.items(), longest, strict=True):
            slot = torch.zeros(size, dtype=local.dtype, device=local.device)
            slot[: local.numel()] = local
            out = torch.empty(context.world * size, dtype=local.dtype, device=local.device)
            futures.append(allgather(out, slot, context.group, f"{name} all_gather"))
            buffers.append(out.view(context.world, size))

        def finish(_: torch.futures.Future[Any]) -> Delivery:
            for future in futures:
                future.value()  # re-raises a failed gather
            rows = headers.tolist()
            try:
                decoded = [
                    wire.decode(
                        rows[w],
                        {name: buffers[j][w, : lengths[w][j]] for j, name in enumerate(data)},
                        payloads,
                    )
                    for w in range(context.world)
                ]
            except GradsiftError as error:
                return Delivery(sent=[None] * len(parts), error=error)
            for i, part in enumerate(parts):
                part.view(context.result).copy_(
                    codec.decompress([d[i] for d in decoded], part.numel, context.record)
                )
            return Delivery(sent=[e.payload for e in encoded])

        return torch.futures.collect_all(futures).then(finish)


def _gather_headers(lengths: list[int], context: Context) -> torch.Tensor:
    """All-gather each worker's header (blocking); return a ``[W, len(lengths)]`` int32 CPU tensor."""
    device = context.result.device
    local = torch.tensor(lengths, dtype=wire.HEADER_DTYPE, device=device)
    out = torch.empty(context.world * len(lengths), dtype=wire.HEADER_DTYPE, device=device)
    guarded("header all_gather", context.group, lambda: all_gather_into(out, local, group=context.group))
    return out.view(context.world, len(lengths)).cpu()
