"""Dense allreduce: parts that every worker lays out identically, summed element-wise.

Carries dense parts (``min_numel``, warm-up, ``none``) and the payloads of compressors
whose payloads have the same layout on every worker (``fp16``/``bf16`` casts, seeded
``randomk``, whose indices every worker regenerates). Per dtype, the parts' sent values
are concatenated into one message ``m``; the exchange computes ``allreduce(m / W)``, the
mean, and splits it back (for a payload: ``decompress`` with the reduced values, e.g.
random-k's scatter at the shared indices).

Non-finite flag: a worker whose input held NaN/Inf fills its message with NaN, so the
reduced mean is NaN on every rank; every rank reads the mean's sum (one pass) and
flags the same step. Bytes: ``bytes_sent = |m|``, no padding, received
``2 (W-1)/W |m|`` (ring).
"""

from __future__ import annotations

import dataclasses

import torch

from gradsift.errors import GradsiftError
from gradsift.exchanges.base import Codec, Context, Delivery, Encoded, Exchange, Part
from gradsift.exchanges.collectives import Pending, allreduce_sum, ring_allreduce_received
from gradsift.validation import all_finite


class Allreduce(Exchange):
    """One ``allreduce`` of the mean per dtype of the sent values (see the module docstring)."""

    name = "allreduce"

    def start(self, parts: list[Part], codec: Codec | None, context: Context) -> Pending[Delivery]:
        encoded: list[Encoded | None] = [
            None if codec is None else codec.encode(part, context.record) for part in parts
        ]
        poisoned = any(e is not None and e.nonfinite for e in encoded)
        sent = [_sent_values(part, enc) for part, enc in zip(parts, encoded, strict=True)]
        groups: dict[torch.dtype, list[int]] = {}
        for i, values in enumerate(sent):
            groups.setdefault(values.dtype, []).append(i)
        reductions = []
        for members in groups.values():
            joined = torch.cat([sent[i] for i in members]) if len(members) > 1 else sent[members[0]]
            message = torch.full_like(joined, float("nan")) if poisoned else torch.div(joined, context.world)
            nbytes = message.numel() * message.element_size()
            context.record.add_bytes(
                sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, context.world)
            )
            reductions.append(allreduce_sum(message, context.group))

        def finish(messages: list[torch.Tensor]) -> Delivery:
            if not all(all_finite(mean) for mean in messages):
                return Delivery(sent=[None] * len(parts), nonfinite=True)
            for members, mean in zip(groups.values(), messages, strict=True):
                _split(mean, [parts[i] for i in members], [encoded[i] for i in members], codec, context)
            return Delivery(sent=[None if e is None else e.wire for e in encoded])

        return Pending.gather(reductions).then(finish)

    def start_in_place(self, buffer: torch.Tensor, context: Context, check: bool) -> Pending[bool]:
        """Stock DDP's own exchange of a whole bucket: ``buffer <- allreduce(buffer / W)`` in place.

        The result is whether the mean is non-finite (always False without ``check``).
        """
        nbytes = buffer.numel() * buffer.element_size()
        context.record.add_bytes(
            sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, context.world)
        )
        reduction = allreduce_sum(buffer.div_(context.world), context.group)
        return reduction.then(lambda mean: check and not all_finite(mean))


def _sent_values(part: Part, encoded: Encoded | None) -> torch.Tensor:
    """What a part puts into the allreduce: its (compensated) gradient, or its payload's values."""
    if encoded is None:
        return part.input
    if encoded.wire.values is None:
        raise GradsiftError("the allreduce exchange carries payloads with values only")
    return encoded.wire.values


def _split(
    mean: torch.Tensor,
    parts: list[Part],
    encoded: list[Encoded | None],
    codec: Codec | None,
    context: Context,
) -> None:
    """Write each part's slice of the reduced ``mean`` into the result (payloads decoded)."""
    start = 0
    for part, enc in zip(parts, encoded, strict=True):
        count = _sent_values(part, enc).numel()
        values = mean[start : start + count]
        start += count
        if enc is None or codec is None:
            part.view(context.result).copy_(values)
        else:
            reduced = dataclasses.replace(enc.payload, values=values)
            part.view(context.result).copy_(codec.decompress([reduced], part.numel, context.record))
