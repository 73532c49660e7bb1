"""Hard threshold: send every element with ``|g| > eta`` for a fixed, user-chosen ``eta``.

Also home of the comparison pass that threshold-based sparsifiers end with:
:func:`select_above_threshold` (chunked, one read of memory; SIDCo and this class) and
:func:`indices_above` (on magnitudes a caller already holds at full size, as DGC does).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Sparsifier
from gradsift.validation import check_real, raise_if_nonfinite

#: Elements per chunk of the final selection: the abs/compare temporaries (~1.3 MiB
#: for fp32) stay in cache instead of round-tripping through memory.
SELECTION_CHUNK = 1 << 18


def select_above_threshold(flat: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of ``|flat| > eta`` (int64, ascending) and ``max |flat|`` (NaN if any NaN).

    Works in chunks of :data:`SELECTION_CHUNK` elements so that ``|flat|`` and the
    mask never exist at full size: one read of ``flat`` from memory. The maximum is
    a reduction over the cached chunk, returned for the caller's non-finite check.
    """
    pieces = []
    peaks = []
    for start in range(0, flat.numel(), SELECTION_CHUNK):
        magnitudes = flat[start : start + SELECTION_CHUNK].abs()
        peaks.append(magnitudes.amax())
        pieces.append(torch.nonzero(magnitudes > eta).view(-1).add_(start))
    return torch.cat(pieces), torch.stack(peaks).amax()


def indices_above(magnitudes: torch.Tensor, eta: float) -> torch.Tensor:
    """Positions ``i`` with ``magnitudes[i] > eta`` -- or ``magnitudes[i]`` NaN.

    Written as ``not (m <= eta)`` so that a NaN, for which every comparison is
    false, is *selected*: a caller then detects a non-finite gradient by checking
    only the selected values (``+Inf`` exceeds every finite ``eta`` anyway), never
    with an extra pass over all ``n`` elements. The comparison runs in the
    magnitudes' dtype (``eta`` is rounded to it). Returns 1-D int64 indices.
    """
    return torch.le(magnitudes, eta).logical_not_().nonzero().view(-1)


def selected_finite(magnitudes: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return ``indices`` after checking the selected magnitudes are finite.

    With a NaN-inclusive selection (:func:`indices_above`, ``torch.topk``) a
    non-finite gradient always has a non-finite element among the selected ones,
    so checking ``len(indices)`` values checks all ``n``.
    """
    raise_if_nonfinite(magnitudes[indices])
    return indices


class HardThreshold(Sparsifier):
    """Send ``{i : |g_i| > eta}`` for a fixed ``eta`` (Strom 2015; Sahu et al. 2021).

    Sahu et al. show the fixed threshold is total-error-optimal under a total
    communication budget: the density follows the data instead of a target, so
    the method has no ``ratio`` and :meth:`options` reports only ``threshold``.

    Options:
        threshold: ``eta``, a finite number > 0 (required). Compared in the
            gradient's dtype, so it is rounded to fp16/bf16 for those gradients.

    Cost: one chunked read of the gradient (:func:`select_above_threshold`); the
    chunks' maxima give the non-finite check.
    """

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        self.threshold = check_real(
            threshold, "threshold", low=0.0, high=math.inf, low_open=True, high_open=True
        )

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        indices, peak = select_above_threshold(flat, self.threshold)
        raise_if_nonfinite(peak)
        return indices
