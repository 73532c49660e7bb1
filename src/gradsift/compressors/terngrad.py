"""TernGrad (Wen et al. 2017): unbiased stochastic rounding to ``{-1, 0, +1} * max|g|``."""

from __future__ import annotations

import torch

from gradsift.compressors.quantization import StochasticQuantizer, compute_dtype
from gradsift.validation import raise_if_nonfinite


class TernGrad(StochasticQuantizer):
    """``terngrad``: send ``s = max_i |g_i|`` and one ternary digit per element.

    1. ``b_i ~ Bernoulli(|g_i| / s)``; the element stands for ``sign(g_i) b_i s``, so
       ``E = g_i`` (unbiased) with variance ``|g_i| (s - |g_i|)``;
    2. the 2-bit code is ``0`` (dropped), ``1`` (``-s``) or ``2`` (``+s``).

    One scale per tensor, as the paper's per-layer scaling (the DDP hook's tensor is a
    bucket, so the maximum is taken over the bucket). Gradient clipping, which the
    paper adds to shrink ``s``, is left to the training loop.

    Options: ``seed`` -- seed of the rounding generator (see :class:`StochasticQuantizer`).
    """

    name = "terngrad"
    code_bits = 2

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        magnitudes = flat.to(compute_dtype(flat.dtype)).abs()
        scale = magnitudes.amax().reshape(1)  # NaN propagates through amax, so this checks every element
        raise_if_nonfinite(scale)
        probability = magnitudes.div_(scale.clamp_min(torch.finfo(scale.dtype).tiny))
        kept = self.uniform(probability) < probability
        codes = (flat > 0).to(torch.int64).add_(1).mul_(kept)
        return codes, scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ternary = torch.tensor([0.0, -1.0, 1.0], dtype=dtype, device=codes.device)
        return ternary[codes].mul_(scales.to(dtype))
