"""QSGD (Alistarh et al. 2017): unbiased stochastic rounding to ``s`` levels of the norm."""

from __future__ import annotations

from typing import Any

import torch

from gradsift.compressors.bitpack import bits_for
from gradsift.compressors.quantization import StochasticQuantizer, rows
from gradsift.core.precision import working_dtype
from gradsift.core.validation import check_int

#: Largest ``levels``: signed levels ``[-s, s]`` then fit 8-bit codes (the widest bitpack packs).
MAX_LEVELS = 127


class QSGD(StochasticQuantizer):
    """``qsgd``: per bucket of ``d`` elements, send ``||g_b||_2`` and one signed level per element.

    For element ``i`` of bucket ``b`` with ``r_i = s |g_i| / ||g_b||_2`` in ``[0, s]``:

    1. ``l_i = floor(r_i) + xi_i`` with ``xi_i ~ Bernoulli(r_i - floor(r_i))``, so
       ``E[l_i] = r_i`` (unbiased);
    2. the code is ``sign(g_i) l_i + s`` in ``[0, 2s]``, packed into
       ``bits_for(2s)`` bits (``s = 15``: 5 bits, ``s = 127``: 8 bits);
    3. decoding gives ``(code - s) ||g_b||_2 / s``, whose variance per element is
       ``(||g_b||_2 / s)^2 f_i (1 - f_i)`` with ``f_i = r_i - floor(r_i)``; summed over a
       bucket it is at most ``min(d / s^2, sqrt(d) / s) ||g_b||^2`` (the paper's bound).

    Options:
        levels: ``s``, quantization levels per sign, in [1, 127]; default 15 (5-bit codes).
        bucket_size: ``d``, elements sharing one norm, >= 1, or None for one norm per
            tensor (the paper's plain QSGD); default 512, as in the paper's experiments,
            because the variance grows with ``sqrt(d)``. Costs 32 bits per bucket.
        seed: seed of the rounding generator (see :class:`StochasticQuantizer`).
    """

    name = "qsgd"

    def __init__(self, levels: int = 15, bucket_size: int | None = 512, seed: int = 0) -> None:
        super().__init__(seed)
        self.levels = check_int(levels, "levels", low=1, high=MAX_LEVELS)
        self.bucket_size = None if bucket_size is None else check_int(bucket_size, "bucket_size", low=1)
        self.code_bits = bits_for(2 * self.levels)

    def options(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket_size": self.bucket_size, **super().options()}

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buckets = self._buckets(flat, fill=0.0, dtype=working_dtype(flat.dtype))
        norms = torch.linalg.vector_norm(buckets, dim=1)
        tiny = torch.finfo(norms.dtype).tiny
        ratio = buckets.abs().mul_((self.levels / norms.clamp_min(tiny)).unsqueeze(1)).clamp_(max=self.levels)
        levels = ratio.floor()
        fraction = ratio.sub_(levels)
        # Bernoulli(fraction) as 0.0 / 1.0, written over the draws (no mask of its own)
        levels.add_(self.uniform(fraction).lt_(fraction))
        codes = levels.copysign_(buckets).add_(self.levels).view(-1)[: flat.numel()]
        return codes.to(torch.uint8), norms

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        signed = self._buckets(codes, fill=self.levels, dtype=dtype).sub_(self.levels)
        return signed.mul_((scales.to(dtype) / self.levels).unsqueeze(1)).view(-1)[: codes.numel()]

    def _buckets(self, flat: torch.Tensor, fill: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``flat`` as rows of ``bucket_size`` (one row when None), the last padded with ``fill``,
        in ``dtype`` (default ``flat``'s)."""
        return rows(flat, self.bucket_size or max(1, flat.numel()), fill, dtype)
