"""Delegated: a compressor that runs its own collectives between its two halves (PowerSGD).

PowerSGD communicates *between* its matrix products (allreduce ``P``, orthogonalise,
``Q = M^T P``, allreduce ``Q``), so it has no single ``compress``/``decompress``. Such a
compressor offers ``ddp_hook(process_group, bucket) -> Future[Tensor]`` (PyTorch's
hook contract) and ``will_compress(bucket) -> bool``; this exchange hands it the bucket
holding the *compensated* gradient (gradsift's error feedback, in the shared store,
replaces the compressor's own) and takes care of the rest:

* the result is copied into the bucket's result tensor; what this worker's
  contribution stands for is the mean it received when the step was compressed
  (error feedback keeps ``c - mean``, PowerSGD's own rule); in its dense warm-up steps
  all of ``c`` was sent (nothing is left over);
* non-finite flag: a NaN/Inf input spreads through the allreduces of ``P`` and ``Q``
  into every rank's result, whose sum every rank computes on the device;
* bytes: what the compressor reports (``hook_nbytes(bucket)``), received as a ring
  allreduce of that many bytes.

The compressor's future is waited for on the training thread like every other
exchange's result. What a compressor chains onto its collectives must not run on the
backend's threads (docs/decisions.md, "Clean exit"): PowerSGD runs PyTorch's hook
inside :func:`~gradsift.compressors.pytorch_hooks.collectives_done_on_return`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from gradsift.core.collectives import Pending, ring_allreduce_received, timed_wait
from gradsift.core.errors import InvalidOptionError
from gradsift.core.finite import nonfinite
from gradsift.core.parts import Context, Outcome, Part
from gradsift.exchanges.base import Codec, Exchange


@runtime_checkable
class DelegatingCompressor(Protocol):
    """What a compressor offers to run its own collectives (PowerSGD)."""

    def will_compress(self, bucket: Any) -> bool: ...

    def ddp_hook(self, process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]: ...

    def hook_nbytes(self, bucket: Any) -> int: ...


class Delegated(Exchange):
    """Hand the whole bucket to the compressor's own ``ddp_hook`` (see the module docstring)."""

    name = "delegated"
    reduces = True
    whole_bucket = True

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        if len(parts) != 1 or parts[0].numel != context.result.numel():
            raise InvalidOptionError(
                "the delegated exchange takes the whole bucket as one part (granularity='bucket')"
            )
        (part,) = parts
        compressor, bucket = codec.compressor, context.bucket
        if not isinstance(compressor, DelegatingCompressor):
            raise InvalidOptionError(
                f"{compressor.name} has no ddp_hook/will_compress/hook_nbytes to delegate to"
            )
        buffer = bucket.buffer()
        if part.input is not part.flat:
            buffer.copy_(part.input)
        compressing = bool(compressor.will_compress(bucket))
        future = compressor.ddp_hook(context.group, bucket)
        nbytes = int(compressor.hook_nbytes(bucket))
        context.record.add_bytes(
            sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, context.world)
        )
        context.record.add_tensor(nbytes // buffer.element_size(), dense=not compressing)  # values sent

        def finish(mean: torch.Tensor) -> Outcome:
            view = part.view(context.result)
            if mean.data_ptr() != view.data_ptr():
                view.copy_(mean)
            return Outcome.of(parts, [view if compressing else None], nonfinite=nonfinite(view))

        result = Pending(lambda: timed_wait(f"{compressor.name} exchange", context.group, future.wait))
        return result.then(finish)
