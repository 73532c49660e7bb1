"""Top-k: the exact ``k = max(1, floor(n * ratio))`` largest magnitudes."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.validation import raise_if_nonfinite


class TopK(Sparsifier):
    """Send the ``k`` elements of largest ``|g|`` (``torch.topk``, unsorted).

    Options: ``ratio`` -- target density delta in (0, 1].
    """

    name = "topk"

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        k = target_count(flat.numel(), self.ratio)
        magnitudes, indices = torch.topk(flat.abs(), k, sorted=False)
        # NaN sorts above every number and Inf is the largest value, so a non-finite
        # input always reaches the selection: checking k values checks all n.
        raise_if_nonfinite(magnitudes)
        return indices
