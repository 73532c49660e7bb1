"""Hard threshold: send every element with ``|g| > eta`` for a fixed, user-chosen ``eta``.

Also home of :func:`selected_finite`, the non-finite check the threshold sparsifiers
(SIDCo, DGC, this class) end with: their comparison pass
(:func:`gradsift.kernels.select_above_threshold`) selects NaN and Inf, so a check of
the ``~k`` selected values is a check of all ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Sparsifier
from gradsift.kernels import select_above_threshold
from gradsift.validation import check_real, raise_if_nonfinite


def selected_finite(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return ``indices`` after checking ``values[indices]`` are finite.

    ``values`` is the gradient or its magnitudes. With a NaN-inclusive selection
    (:func:`gradsift.kernels.select_above_threshold`, ``torch.topk``) a
    non-finite gradient always has a non-finite element among the selected ones,
    so checking ``len(indices)`` values checks all ``n``.
    """
    raise_if_nonfinite(values.index_select(0, indices))
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
