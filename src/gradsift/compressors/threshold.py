"""Hard threshold: send every element with ``|g| > eta`` for a fixed, user-chosen ``eta``.

Also home of :func:`threshold_selection`, the selection every threshold sparsifier (SIDCo,
DGC, RedSync, GaussianK, this class) ends with: the elements that pass their test
(:mod:`gradsift.compressors.kernels`), and when there are more than the payload's capacity, the
largest of them (:func:`gradsift.compressors.kernels.keep_largest`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.kernels import Candidates, Threshold, select_above, select_mask
from gradsift.core.readout import Readout
from gradsift.core.validation import check_ratio, check_real


def threshold_selection(flat: torch.Tensor, eta: Threshold, capacity: int | None) -> Selection:
    """``{i : |flat_i| > eta}`` (NaN and Inf included, whatever ``eta`` is), cut to the
    ``capacity`` largest when over it."""
    candidates = select_above(flat, eta, capacity)
    assert candidates.nonfinite is not None  # select_above always checks
    return _selection(candidates, candidates.nonfinite)


def mask_selection(
    flat: torch.Tensor, mask: torch.Tensor, capacity: int | None, nonfinite: torch.Tensor
) -> Selection:
    """The elements where ``mask`` holds, cut to the ``capacity`` largest of ``|flat|`` when over it."""
    return _selection(select_mask(mask, capacity, flat), nonfinite)


def selection_with_maximum(
    flat: torch.Tensor, eta: torch.Tensor, top: torch.Tensor, capacity: int | None
) -> Selection:
    """:func:`threshold_selection` of ``|flat| > eta`` and of the elements at the maximum
    magnitude ``top`` when ``top > 0``, so that a tensor whose elements all tie (a constant
    one, where a threshold between the mean and the maximum lets nothing through) still sends
    them and error feedback never stalls. One test: ``|flat| > min(eta, the float below top)``
    (``top`` is 0: nothing passes; NaN: only the NaN and Inf elements pass, and are flagged)."""
    below_top = torch.nextafter(top, torch.zeros_like(top))
    return threshold_selection(flat, torch.minimum(eta, below_top), capacity)


def _selection(candidates: Candidates, nonfinite: torch.Tensor) -> Selection:
    return Selection(candidates.indices, candidates.length, nonfinite, demand=candidates.selected)


class HardThreshold(Sparsifier):
    """Send ``{i : |g_i| > eta}`` for a fixed ``eta`` (Strom 2015; Sahu et al. 2021).

    Sahu et al. show the fixed threshold is total-error-optimal under a total
    communication budget: the density follows the data instead of a target, so the
    method has no ``ratio``. Under the DDP hook the payload's capacity follows the
    counts of earlier steps (``adaptive_capacity``; the first step's is ``first_ratio``
    of the elements); when more elements pass than there is room for, the largest go
    and the rest wait in error feedback. It travels by the allgather (default) or the
    shared mask, which report the demand.

    Options:
        threshold: ``eta``, a finite number > 0 (required). Compared in the
            gradient's dtype, so it is rounded to fp16/bf16 for those gradients.
        first_ratio: the first step's capacity as a fraction of the elements, in (0, 1]
            (default 0.01).

    Cost: one read of the gradient (:func:`gradsift.compressors.kernels.select_above`); the
    non-finite check reads only the selected values.
    """

    density_option = "threshold"

    name = "threshold"
    adaptive_capacity = True
    # Not the balanced exchange: its re-sparsified slices report no demand, so the
    # capacity would stay at first_ratio's, a hidden ratio in place of the threshold.
    exchanges = ("allgather", "shared-mask")

    def __init__(self, threshold: float, first_ratio: float = 0.01) -> None:
        self.threshold = check_real(
            threshold, "threshold", low=0.0, high=math.inf, low_open=True, high_open=True
        )
        self.first_ratio = check_ratio(first_ratio, "first_ratio")

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "first_ratio": self.first_ratio}

    def capacity(self, numel: int) -> int | None:
        return target_count(numel, self.first_ratio)

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        return threshold_selection(flat, self.threshold, capacity)
