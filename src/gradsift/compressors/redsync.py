"""RedSync (Fang et al. 2019): binary search of a threshold between the mean and the max of |g|."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.validation import check_int, raise_if_nonfinite


class RedSync(Sparsifier):
    """RedSync's trimmed top-k selection.

    For ``a = |g|`` with mean ``m`` and maximum ``M``, and ``k = max(1, floor(n * ratio))``:

    1. ``eta(r) = m + r (M - m)``, searched over ``r`` in ``[lo, hi] = [0, 1]``.
    2. Up to ``iterations`` times: ``r = (lo + hi) / 2``, ``c = #{a_i > eta(r)}``;
       ``c < k``: ``hi = r``; ``c > 2k``: ``lo = r``; else stop with ``lo = r``.
    3. Send ``{i : a_i > eta(lo)}``: the bracket's hit, or else the highest ``r``
       seen that still selected at least ``k`` (``r = 0``, the mean, when none did --
       then fewer than ``k`` can be sent: the method cannot go below the mean).
    4. Only if that selects nothing from a non-zero gradient (every element tied at
       ``M``, e.g. a constant tensor) fall back to exact top-k, so error feedback
       never stalls.

    Options:
        ratio: target density in (0, 1].
        iterations: bound on the search steps, integer in [1, 64] (default 10).

    Cost: ``abs``, one mean/max pass, one count pass per search step, one
    ``nonzero`` pass. The maximum doubles as the non-finite check (it propagates
    NaN and is Inf when any element is).
    """

    name = "redsync"

    def __init__(self, ratio: float = 0.01, iterations: int = 10) -> None:
        super().__init__(ratio)
        self.iterations = check_int(iterations, "iterations", low=1, high=64)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "iterations": self.iterations}

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        k = target_count(flat.numel(), self.ratio)
        magnitudes = flat.abs()
        maximum = magnitudes.max()
        raise_if_nonfinite(maximum)
        mean, top = float(magnitudes.mean()), float(maximum)
        lo, hi = 0.0, 1.0
        selected = None  # the mask at eta(lo), once evaluated
        for _ in range(self.iterations):
            r = (lo + hi) / 2
            mask = magnitudes > mean + r * (top - mean)
            count = int(torch.count_nonzero(mask))
            if count < k:
                hi = r
            else:
                lo, selected = r, mask
                if count <= 2 * k:
                    break
        if selected is None:
            selected = magnitudes > mean
        indices = selected.nonzero().view(-1)
        if indices.numel() == 0 and top > 0:
            indices = torch.topk(magnitudes, k, sorted=False).indices
        return indices
