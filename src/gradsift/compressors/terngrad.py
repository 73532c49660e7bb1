"""TernGrad (Wen et al. 2017): clip, then unbiased stochastic rounding to ``{-1, 0, +1} * s``."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsift.compressors.quantization import StochasticQuantizer
from gradsift.core.precision import working_dtype
from gradsift.core.validation import check_real

#: The paper's clipping factor ``c``: elements beyond ``c`` standard deviations are clipped.
PAPER_CLIP = 2.5


class TernGrad(StochasticQuantizer):
    """``terngrad``: clip to ``c * sigma``, send ``s = max_i |h_i|`` and one ternary digit per element.

    1. clipping (the paper's "gradient clipping", on by default): ``h_i = sign(g_i)
       min(|g_i|, c sigma)`` with ``sigma = sqrt(mean_i g_i^2)``, the tensor's standard
       deviation about zero (the paper's sigma for a zero-mean gradient; about zero, not
       the mean, because the bound applies to ``|g_i|``: a tensor with a large mean, such
       as a bias, is not cut to a fraction of itself). A few outliers then no longer set
       the scale of the whole tensor;
    2. ``s = max_i |h_i|``, ``b_i ~ Bernoulli(|h_i| / s)``; the element stands for
       ``sign(h_i) b_i s``, so ``E = h_i`` (unbiased for ``h``) with variance
       ``|h_i| (s - |h_i|)``; clipping trades that variance for the bias ``h_i - g_i``;
    3. the 2-bit code is ``0`` (dropped), ``1`` (``-s``) or ``2`` (``+s``).

    One scale per tensor. The paper's per-layer scale is the DDP hook's
    ``granularity="layer"`` (one tensor per parameter); with the default bucket
    granularity the scale and sigma are the bucket's.

    Options:
        clip: ``c``, > 0, or None for no clipping; default 2.5 (the paper's).
        seed: seed of the rounding generator (see :class:`StochasticQuantizer`).
    """

    name = "terngrad"
    code_bits = 2

    def __init__(self, clip: float | None = PAPER_CLIP, seed: int = 0) -> None:
        super().__init__(seed)
        self.clip = None if clip is None else check_real(clip, "clip", low=0.0, low_open=True)

    def options(self) -> dict[str, Any]:
        return {"clip": self.clip, **super().options()}

    def clipped_magnitudes(self, values: torch.Tensor) -> torch.Tensor:
        """``|h|``: ``|values|`` capped at ``c sqrt(mean(values^2))`` (uncapped without clipping).

        ``sqrt(mean(values^2))`` is ``||values||_2 / sqrt(n)``, one reduction; the cap is in
        place on the magnitudes (clipping never changes a sign, so ``h``'s signs are
        ``values``'). A NaN or Inf makes the bound NaN or Inf, which the cap passes on.
        """
        magnitudes = values.abs()
        if self.clip is None:
            return magnitudes
        bound = torch.linalg.vector_norm(values).mul_(self.clip / math.sqrt(values.numel()))
        return magnitudes.clamp_max_(bound)

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = flat.to(working_dtype(flat.dtype))
        magnitudes = self.clipped_magnitudes(values)
        scale = magnitudes.amax().reshape(1)  # NaN propagates through amax: the flag checks every element
        probability = magnitudes.div_(scale.clamp_min(torch.finfo(scale.dtype).tiny))
        kept = self.uniform(probability) < probability
        # the sign mask's bytes (0 or 1) made the codes in place: 1 + positive where kept, else 0
        codes = (values > 0).view(torch.uint8).add_(1).mul_(kept)
        return codes, scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # 0 -> 0, 1 -> -1, 2 -> +1 (and a peer's invalid 3 -> 0): arithmetic, no lookup table to copy
        ternary = (codes >> 1).to(dtype).sub_((codes & 1).to(dtype))
        return ternary.mul_(scales.to(dtype))
