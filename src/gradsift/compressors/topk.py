"""Top-k: the exact ``k = max(1, floor(n * ratio))`` largest magnitudes."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.largest import largest_magnitudes
from gradsift.core.readout import Readout


def top_k_selection(
    flat: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, magnitudes, kth, nonfinite)`` of the ``k`` largest ``|flat|``, in position order.

    :func:`~gradsift.compressors.largest.largest_magnitudes` (``torch.topk``; a radix select
    on CPU), then the ``k`` positions sorted (the wire sends them ascending) with their
    magnitudes; ``kth`` is the k-th largest magnitude (the smallest
    selected one). NaN sorts above every number and Inf is the largest value, so a
    non-finite input always reaches the selection: the ``aminmax`` of the ``k`` selected
    magnitudes (one kernel) gives both ``kth`` and the check of all ``n`` elements,
    ``nonfinite`` (0-d bool). No host read.
    """
    magnitudes, indices = largest_magnitudes(flat, k)
    indices, order = torch.sort(indices)
    magnitudes = magnitudes.index_select(0, order)
    smallest, largest = torch.aminmax(magnitudes)
    return indices, magnitudes, smallest, ~torch.isfinite(largest)


class TopK(Sparsifier):
    """Send the ``k`` elements of largest ``|g|`` (:func:`top_k_selection`).

    Options: ``ratio`` -- target density delta in (0, 1].
    """

    name = "topk"

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        k = target_count(flat.numel(), self.ratio)
        indices, _, _, nonfinite = top_k_selection(flat, k)
        return Selection(indices, None, nonfinite)
