"""Dense baselines: no compression, and 16-bit casts (fp16, bf16).

These go through a plain allreduce. The honest dense baseline for a comparison is
the 16-bit one, which halves the bytes at almost no cost.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.readout import Readout


class Cast(Compressor):
    """Send every element, cast to ``wire_dtype`` (or as is when it is None).

    ``decompress`` sums the workers' values in the gradient's own dtype and divides
    by the number of workers. A NaN or Inf travels in the values themselves (the payload
    carries every element, ``nonfinite=None``), as with stock DDP.
    """

    exchanges = ("allreduce",)
    error_feedback = False
    wire_dtype: ClassVar[torch.dtype | None] = None

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        values = flat if self.wire_dtype is None else flat.to(self.wire_dtype)
        return Payload(numel=flat.numel(), dtype=flat.dtype, values=values, variable_size=False)

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        if not payloads:
            raise InvalidOptionError("payloads must hold at least one payload")
        dtype = payloads[0].dtype
        total: torch.Tensor | None = None
        for payload in payloads:
            if payload.values is None or payload.values.numel() != numel:
                count = None if payload.values is None else payload.values.numel()
                raise InvalidOptionError(f"payload holds {count} values, expected numel={numel}")
            values = payload.values.to(dtype)
            total = values.clone() if total is None else total.add_(values)
        assert total is not None
        if len(payloads) > 1:
            total /= len(payloads)
        return total

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor | None:
        """:meth:`decompress` written straight into ``out``: the same sum in the same order,
        the values cast as they are read (no widened copy of a payload, no separate total).
        Only where that cast is exact (into float32 or float64); else :meth:`decompress`."""
        if not payloads or out.dtype != payloads[0].dtype or out.dtype not in (torch.float32, torch.float64):
            return super().decompress_into(payloads, out)
        for i, payload in enumerate(payloads):
            if payload.values is None or payload.values.numel() != out.numel():
                count = None if payload.values is None else payload.values.numel()
                raise InvalidOptionError(f"payload holds {count} values, expected numel={out.numel()}")
            if i == 0:
                out.copy_(payload.values)
            else:
                out.add_(payload.values)
        if len(payloads) > 1:
            out /= len(payloads)
        return None


class NoCompression(Cast):
    """``none``: the gradient as it is (fp32 allreduce for fp32 models)."""

    name = "none"
    identity = True


class Float16(Cast):
    """``fp16``: cast to IEEE half precision for the exchange (overflows above 65504)."""

    name = "fp16"
    wire_dtype = torch.float16


class BFloat16(Cast):
    """``bf16``: cast to bfloat16 for the exchange (fp32's range, 8 bits of mantissa)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
