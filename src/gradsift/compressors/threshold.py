"""Hard threshold: send every element with ``|g| > eta`` for a fixed, user-chosen ``eta``.

Also home of :func:`indices_above`, the one comparison pass that every
threshold-based sparsifier (DGC, RedSync, GaussianK) ends with.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Sparsifier
from gradsift.validation import check_real, raise_if_nonfinite


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

    Cost: one ``abs`` pass, one comparison pass, one ``nonzero`` pass; the
    non-finite check reads only the selected values.
    """

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        self.threshold = check_real(
            threshold, "threshold", low=0.0, high=math.inf, low_open=True, high_open=True
        )

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        magnitudes = flat.abs()
        return selected_finite(magnitudes, indices_above(magnitudes, self.threshold))
