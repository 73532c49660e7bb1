"""Block-scaled integer quantization: ``b``-bit round-to-nearest with one absmax scale per block.

What low-communication training sends as the averaged model delta (Streaming DiLoCo's 4-bit
outer gradients, SparseLoCo's 2-bit values): for each block ``B`` of ``d`` elements,

    s_B = max_{i in B} |x_i|,        L = 2^(b-1) - 1 levels per sign,
    q_i = round(L x_i / s_B)  in [-L, L],      code_i = q_i + L  (b bits),
    decode(code_i) = (code_i - L) s_B / L.

Deterministic rounding is biased, so the method runs with error feedback (the residual
``x - decode(code)`` waits for the next exchange; ``error_feedback = True``): the
quantization error of one round is sent in the next, as in SparseLoCo. ``b = 2`` leaves
``L = 1``: each element is ``-s_B``, 0 or ``+s_B`` (ternary). Bytes: ``ceil(n b / 8)`` of
codes plus ``4 ceil(n / d)`` of float32 scales (at ``d = 64``: half a bit per element).
Codes of different workers refer to different scales, so the payloads are allgathered.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsift.compressors.quantization import Quantizer, rows
from gradsift.core.errors import InvalidOptionError
from gradsift.core.precision import working_dtype
from gradsift.core.validation import check_int

#: The code widths offered: bytes, nibbles and the ternary 2-bit code.
BITS = (2, 4, 8)


class BlockQuantizer(Quantizer):
    """``blockquant``: ``bits``-bit codes, round to nearest, one absmax scale per ``block_size``.

    Options:
        bits: code width, one of 2, 4, 8 (default 4).
        block_size: elements sharing one scale, >= 1 (default 64).
    """

    name = "blockquant"
    error_feedback = True
    server_stage = True  # deterministic, stateless, the same on every rank
    exchanges = ("allgather", "two-stage")

    def __init__(self, bits: int = 4, block_size: int = 64) -> None:
        if bits not in BITS or isinstance(bits, bool):
            raise InvalidOptionError(f"bits must be one of {', '.join(map(str, BITS))}; got {bits!r}")
        self.code_bits = int(bits)
        self.block_size = check_int(block_size, "block_size", low=1)
        self.levels = 2 ** (self.code_bits - 1) - 1

    def options(self) -> dict[str, Any]:
        return {"bits": self.code_bits, "block_size": self.block_size}

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = rows(flat, self.block_size, fill=0.0, dtype=working_dtype(flat.dtype))
        scales = blocks.abs().amax(dim=1)  # NaN/Inf in a block makes its scale non-finite
        tiny = torch.finfo(scales.dtype).tiny
        levels = blocks.mul((self.levels / scales.clamp_min(tiny)).unsqueeze(1)).round_()
        codes = levels.clamp_(-self.levels, self.levels).add_(self.levels).view(-1)[: flat.numel()]
        return codes.to(torch.uint8), scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        signed = rows(codes, self.block_size, fill=self.levels, dtype=dtype).sub_(self.levels)
        return signed.mul_((scales.to(dtype) / self.levels).unsqueeze(1)).view(-1)[: codes.numel()]
