"""Top-k: the exact ``k = max(1, floor(n * ratio))`` largest magnitudes."""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.errors import NonFiniteGradientError


def top_k_selection(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(indices, magnitudes, kth)`` of the ``k`` largest ``|flat|`` (``torch.topk``, unsorted).

    ``kth`` is the k-th largest magnitude (the smallest selected one).

    NaN sorts above every number and Inf is the largest value, so a non-finite input
    always reaches the selection: the ``aminmax`` of the ``k`` selected magnitudes
    (one kernel) gives both the k-th magnitude and the check of all ``n`` elements.
    Raises :class:`NonFiniteGradientError` for a NaN or Inf.
    """
    magnitudes, indices = torch.topk(flat.abs(), k, sorted=False)
    smallest, largest = (float(m) for m in torch.aminmax(magnitudes))
    if not math.isfinite(largest):  # aminmax propagates NaN
        raise NonFiniteGradientError("gradient contains NaN or Inf values")
    return indices, magnitudes, smallest


class TopK(Sparsifier):
    """Send the ``k`` elements of largest ``|g|`` (:func:`top_k_selection`).

    Options: ``ratio`` -- target density delta in (0, 1].
    """

    name = "topk"

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        return top_k_selection(flat, target_count(flat.numel(), self.ratio))[0]
