"""Dense reduce-scatter: every worker receives the mean of its own shard (FSDP's sharded strategies).

FSDP1's ``FULL_SHARD`` and ``SHARD_GRAD_OP`` hand their hook the padded flat gradient of
a unit and the shard that worker must fill. Only elementwise sums fit there, so this
exchange carries the dense casts (``none``, ``fp16``, ``bf16``): the message is
``cast(g) / W`` (the division happens in the cast dtype before the sum, as the
allreduce exchange does), one ``reduce_scatter`` writes this worker's shard of the sum
into ``context.result`` (the shard), back in the gradient's dtype. A NaN/Inf in any
worker's gradient reaches every shard (it travels in the values); every worker sums its
shard on the device for the flag of its :class:`~gradsift.core.parts.Outcome`. Bytes: sent ``|m|`` (the
message, as the allreduce exchange counts it), received ``(W-1)/W |m|`` (ring).

Not in the registry: DDP has no shards, so no DDP compressor travels by it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsift.core.collectives import Pending, guarded, started
from gradsift.core.errors import GradsiftError
from gradsift.core.finite import nonfinite
from gradsift.core.parts import Context, Outcome, Part
from gradsift.exchanges.base import Codec, Exchange

# torch >= 2.13 renames reduce_scatter_tensor (same signature) and deprecates the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceScatter(Exchange):
    """``result <- reduce_scatter(cast(g) / W)`` of one padded flat gradient (module docstring)."""

    name = "reduce-scatter"
    reduces = True

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        if len(parts) != 1:
            raise GradsiftError("the reduce-scatter exchange takes one flat gradient")
        encoded = codec.encode(parts[0], context)
        values = encoded.wire.values
        if values is None or encoded.wire.indices is not None:
            raise GradsiftError("the reduce-scatter exchange carries dense payloads only")
        message = torch.div(values, context.world)
        shard = torch.empty(context.result.numel(), dtype=message.dtype, device=message.device)
        nbytes = message.numel() * message.element_size()
        context.record.add_bytes(
            sent=nbytes, padded=nbytes, received=(context.world - 1) * nbytes // context.world
        )
        group = context.group
        work = guarded(
            "reduce-scatter", group, lambda: _reduce_scatter(shard, message, group=group, async_op=True)
        )

        def finish(reduced: torch.Tensor) -> Outcome:
            context.result.copy_(reduced)
            flagged = nonfinite(context.result) if codec.checks_values else None
            return Outcome.of(parts, [None], nonfinite=flagged)

        return started(work, shard, group, "reduce-scatter").then(finish)
