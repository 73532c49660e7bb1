"""Dense allreduce: parts that every worker lays out identically, summed element-wise.

Carries dense parts (the identity codec: ``none``, ``min_numel``, warm-up) and the
payloads of compressors whose payloads have the same layout on every worker
(``fp16``/``bf16`` casts, seeded ``randomk``, whose indices every worker regenerates).
Per dtype, the parts' sent values are concatenated into one message ``m``; the exchange
computes ``allreduce(m / W)``, the mean, and splits it back (for a payload: ``decompress``
with the reduced values, e.g. random-k's scatter at the shared indices). A single dense
part that is the bucket itself is reduced in place, as stock DDP does.

Non-finite flag: a NaN/Inf in dense values travels in the values and makes the mean
non-finite on every rank; a payload that carries only some elements (random-k) and
flags its input non-finite adds NaN to its message (``k`` elements). Every rank then
sums the mean on the device and reports the flag in its :class:`~gradsift.core.parts.Outcome` (no host
read); the identity codec of stock DDP's own exchange skips that sum
(``checks_values=False``), exactly like stock DDP. Bytes: ``bytes_sent = |m|``, no
padding, received ``2 (W-1)/W |m|`` (ring).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gradsift.core.collectives import Pending, allreduce_sum, ring_allreduce_received
from gradsift.core.errors import GradsiftError
from gradsift.core.finite import nonfinite
from gradsift.core.mean import divide_, divided
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload
from gradsift.core.telemetry import BucketRecord
from gradsift.exchanges.base import Codec, Encoded, Exchange


class Allreduce(Exchange):
    """One ``allreduce`` of the mean per dtype of the sent values (see the module docstring)."""

    name = "allreduce"
    reduces = True

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        encoded = [codec.encode(part, context) for part in parts]
        values = [_values(e) for e in encoded]
        in_place = (
            len(parts) == 1
            and values[0].data_ptr() == context.result.data_ptr()
            and (values[0].numel() == context.result.numel())
        )
        groups: dict[torch.dtype, list[int]] = {}
        for i, sent in enumerate(values):
            groups.setdefault(sent.dtype, []).append(i)
        reductions = []
        for members in groups.values():
            if in_place:
                message = divide_(values[0], context.world)
            else:
                joined = torch.cat([values[i] for i in members]) if len(members) > 1 else values[members[0]]
                message = divided(joined, context.world)
            poison = _poison([encoded[i] for i in members])
            if poison is not None:
                message = message.add_(poison)
            reductions.append(start_mean_allreduce(message, context.world, context.group, context.record))

        def finish(means: list[torch.Tensor]) -> Outcome:
            if not in_place:
                for members, mean in zip(groups.values(), means, strict=True):
                    _split(mean, [parts[i] for i in members], [encoded[i] for i in members], codec, context)
            nonfinite = any_nonfinite(means) if codec.checks_values else None
            sent: list[Payload | torch.Tensor | None] = [
                None if codec.compressor.identity else e.wire for e in encoded
            ]
            return Outcome.of(parts, sent, nonfinite=nonfinite)

        return Pending.gather(reductions).then(finish)


def start_mean_allreduce(
    message: torch.Tensor, world: int, group: Any, record: BucketRecord
) -> Pending[torch.Tensor]:
    """Start the in-place sum of ``message`` over the group's ``world`` workers, its bytes in
    ``record``: sent ``|m|``, no padding, received ``2 (W-1)/W |m|`` (ring)."""
    nbytes = message.numel() * message.element_size()
    record.add_bytes(sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, world))
    return allreduce_sum(message, group)


def any_nonfinite(means: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool on the device: some reduced tensor holds a NaN or Inf (one sum each, no host read)."""
    return nonfinite(*means)


def _values(encoded: Encoded) -> torch.Tensor:
    """What a part puts into the allreduce: its payload's values."""
    if encoded.wire.values is None:
        raise GradsiftError("the allreduce exchange carries payloads with values only")
    return encoded.wire.values


def _poison(encoded: list[Encoded]) -> torch.Tensor | None:
    """NaN where some payload flags a non-finite input it does not carry, else 0 (None: no such flag)."""
    flags = [e.wire.nonfinite for e in encoded if e.wire.nonfinite is not None]
    if not flags:
        return None
    return torch.where(torch.stack(flags).any(), float("nan"), 0.0)


def _split(
    mean: torch.Tensor, parts: list[Part], encoded: list[Encoded], codec: Codec, context: Context
) -> None:
    """Write each part's slice of the reduced ``mean`` into the result (payloads decoded)."""
    start = 0
    for part, enc in zip(parts, encoded, strict=True):
        count = _values(enc).numel()
        values = mean[start : start + count]
        start += count
        if codec.compressor.identity:
            part.view(context.result).copy_(values)
        else:
            reduced = dataclasses.replace(enc.payload, values=values)
            codec.decompress_into([reduced], part.view(context.result), context.record)
