"""Hard threshold: send every element with ``|g| > eta`` for a fixed, user-chosen ``eta``.

Also home of the comparison pass that threshold-based sparsifiers end with:
:func:`gradsift.kernels.select_above_threshold` (one read of memory; SIDCo and this class) and :func:`indices_above` (on magnitudes a caller already holds at full size,
as DGC does). Both select NaN, so :func:`selected_finite` -- a check of the ``~k``
selected values -- is a check of all ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Sparsifier
from gradsift.kernels import select_above_threshold
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


def selected_finite(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return ``indices`` after checking ``values[indices]`` are finite.

    ``values`` is the gradient or its magnitudes. With a NaN-inclusive selection
    (:func:`select_above_threshold`, :func:`indices_above`, ``torch.topk``) a
    non-finite gradient always has a non-finite element among the selected ones,
    so checking ``len(indices)`` values checks all ``n``.
    """
    raise_if_nonfinite(values[indices])
    return indices


class HardThreshold(Sparsifier):
    """Send ``{i : |g_i| > eta}`` for a fixed ``eta`` (Strom 2015; Sahu et al. 2021).

    Sahu et al. show the fixed threshold is total-error-optimal under a total
    communication budget: the density follows the data instead of a target, so
    the method has no ``ratio`` and :meth:`options` reports only ``threshold``.

    Options:
        threshold: ``eta``, a finite number > 0 (required). Compared in the
            gradient's dtype, so it is rounded to fp16/bf16 for those gradients.

    Cost: one read of the gradient (:func:`select_above_threshold`); the non-finite
    check reads only the selected values.
    """

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        self.threshold = check_real(
            threshold, "threshold", low=0.0, high=math.inf, low_open=True, high_open=True
        )

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        return selected_finite(flat, select_above_threshold(flat, self.threshold))
