"""RedSync (Fang et al. 2019): binary search of a threshold between the mean and the max of |g|."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.counts import count_above
from gradsift.compressors.kernels import uses_numpy
from gradsift.compressors.threshold import selection_with_maximum
from gradsift.core.readout import Readout
from gradsift.core.validation import check_int


class RedSync(Sparsifier):
    """RedSync's trimmed top-k selection.

    For ``a = |g|`` with mean ``m`` and maximum ``M``, and ``k = max(1, floor(n * ratio))``:

    1. ``eta(r) = m + r (M - m)``, searched over ``r`` in ``[lo, hi] = [0, 1]``.
    2. Up to ``iterations`` times: ``r = (lo + hi) / 2``, ``c = #{a_i > eta(r)}``;
       ``c < k``: ``hi = r``; ``c > 2k``: ``lo = r``; else stop with ``lo = r``.
    3. Send ``{i : a_i > eta(lo)}``: the bracket's hit, or else the highest ``r``
       seen that still selected at least ``k`` (``r = 0``, the mean, when none did --
       then fewer than ``k`` can be sent: the method cannot go below the mean).
    4. The elements at the maximum ``M > 0`` are always sent too, so that a gradient
       whose elements all tie at ``M`` (a constant tensor) still sends something and
       error feedback never stalls.

    On a device the search runs there: "stop" freezes ``lo`` and ``hi`` for the remaining
    steps (``torch.where``), so every call makes ``iterations`` count passes and no host
    read. On the CPU, where reading the stop flag through NumPy waits for nothing, the search
    ends at the stop: the same ``lo``, fewer passes. Under the DDP hook the payload has room
    for ``k``: of more, the largest go.

    Options:
        ratio: target density in (0, 1].
        iterations: bound on the search steps, integer in [1, 64] (default 10).

    Cost: ``abs``, one mean/max pass, up to ``iterations`` count passes
    (:func:`~gradsift.compressors.counts.count_above`), one selection pass
    (:func:`~gradsift.compressors.threshold.selection_with_maximum`, whose test passes every NaN
    and Inf element: the non-finite check).
    """

    name = "redsync"

    def __init__(self, ratio: float = 0.01, iterations: int = 10) -> None:
        super().__init__(ratio)
        self.iterations = check_int(iterations, "iterations", low=1, high=64)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "iterations": self.iterations}

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        k = target_count(flat.numel(), self.ratio)
        magnitudes = flat.abs()
        top = magnitudes.max()
        mean = magnitudes.mean()
        lo = torch.zeros((), dtype=mean.dtype, device=flat.device)
        hi = torch.ones_like(lo)
        searching = torch.ones((), dtype=torch.bool, device=flat.device)
        cpu_branch = uses_numpy(flat)  # the stop flag read there, through NumPy, waits for nothing
        for _ in range(self.iterations):
            r = (lo + hi) / 2
            count = count_above(magnitudes, mean + r * (top - mean))
            few = searching & (count < k)
            enough = searching & ~(count < k)
            hi = torch.where(few, r, hi)
            lo = torch.where(enough, r, lo)
            searching = searching & ~(enough & (count <= 2 * k))
            if cpu_branch and not searching.numpy():
                break
        return selection_with_maximum(flat, mean + lo * (top - mean), top, capacity)
