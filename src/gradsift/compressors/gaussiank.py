"""GaussianK-SGD (Shi et al. 2019): a threshold from a normal fit, corrected up to three times."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.stats import normal_two_sided_threshold
from gradsift.validation import raise_if_nonfinite

#: Number of threshold corrections after the first estimate.
CORRECTIONS = 3
#: A count below ``LOW * k`` halves the threshold, above ``HIGH * k`` multiplies it by 1.5.
LOW, HIGH = 2 / 3, 4 / 3


class GaussianK(Sparsifier):
    """GaussianK-SGD's sparsifier.

    For a flat gradient ``g`` and ``k = max(1, floor(n * ratio))``:

    1. Fit a normal to the signed values: ``mu = mean(g)``, ``sigma = std(g)``
       (population, one ``std_mean`` pass).
    2. ``eta = |mu| + sigma * Phi^-1(1 - ratio/2)`` (:func:`gradsift.stats.normal_two_sided_threshold`).
       The paper writes ``mu``; ``|mu|`` is the same for ``mu >= 0`` and keeps
       ``eta`` positive -- so the corrections below move it the right way -- when
       the gradient's bulk is negative.
    3. Count ``c = #{|g_i| > eta}``; up to 3 times: ``c < 2/3 k``: ``eta *= 0.5``,
       ``c > 4/3 k``: ``eta *= 1.5``, else stop. Send ``{i : |g_i| > eta}`` for the
       last ``eta`` (whatever its count after the third correction).
    4. Only if that selects nothing from a non-zero gradient (ties, e.g. a constant
       tensor) fall back to exact top-k, so error feedback never stalls.

    Options:
        ratio: target density in (0, 1].

    Cost: one ``std_mean`` pass, ``abs``, one count pass per evaluation (1 to 4),
    one ``nonzero`` pass. The mean and deviation double as the non-finite check.
    """

    name = "gaussiank"

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        k = target_count(flat.numel(), self.ratio)
        std_tensor, mean_tensor = torch.std_mean(flat, correction=0)
        raise_if_nonfinite(torch.stack((std_tensor, mean_tensor)))
        std, mean = float(std_tensor), float(mean_tensor)
        eta = normal_two_sided_threshold(abs(mean), std, self.ratio)
        magnitudes = flat.abs()
        for correction in range(CORRECTIONS + 1):
            mask = magnitudes > eta
            count = int(torch.count_nonzero(mask))
            if correction == CORRECTIONS or LOW * k <= count <= HIGH * k:
                break
            eta *= 0.5 if count < LOW * k else 1.5
        indices = mask.nonzero().view(-1)
        if indices.numel() == 0 and (std > 0 or mean != 0):
            indices = torch.topk(magnitudes, k, sorted=False).indices
        return indices
