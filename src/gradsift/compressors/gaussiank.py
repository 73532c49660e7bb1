"""GaussianK-SGD (Shi et al. 2019): a threshold from a normal fit, corrected up to three times."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.counts import count_above
from gradsift.compressors.kernels import uses_numpy
from gradsift.compressors.stats import normal_two_sided_threshold
from gradsift.compressors.threshold import selection_with_maximum
from gradsift.core.readout import Readout

#: Number of threshold corrections after the first estimate (the paper's).
CORRECTIONS = 3
#: Further halvings while fewer than ``LOW * k`` pass (module docstring of :class:`GaussianK`, step 4).
RESCUES = 7
#: A count below ``LOW * k`` halves the threshold, above ``HIGH * k`` multiplies it by 1.5.
LOW, HIGH = 2 / 3, 4 / 3


class GaussianK(Sparsifier):
    """GaussianK-SGD's sparsifier.

    For a flat gradient ``g`` and ``k = max(1, floor(n * ratio))``:

    1. Fit a normal to the signed values: ``mu = mean(g)``, ``sigma = std(g)``
       (population, one ``std_mean`` pass).
    2. ``eta = |mu| + sigma * Phi^-1(1 - ratio/2)`` (:func:`gradsift.compressors.stats.normal_two_sided_threshold`).
       The paper writes ``mu``; ``|mu|`` is the same for ``mu >= 0`` and keeps
       ``eta`` positive -- so the corrections below move it the right way -- when
       the gradient's bulk is negative.
    3. Count ``c = #{|g_i| > eta}``; up to 3 times: ``c < 2/3 k``: ``eta *= 0.5``,
       ``c > 4/3 k``: ``eta *= 1.5``, else stop.
    4. Not in the paper: while ``c < 2/3 k`` still, halve ``eta`` up to :data:`RESCUES` more
       times. A few large entries make the fit's ``sigma`` (error feedback's residuals do,
       under momentum correction), and three corrections, at most ``8x`` down, can leave one
       element passing: the run then sends one element a step and diverges
       (docs/decisions.md). Send ``{i : |g_i| > eta}`` for the last ``eta``.
    5. The elements at the maximum magnitude ``M > 0`` are always sent too, so that a
       gradient of ties (a constant tensor) still sends something and error feedback
       never stalls.

    On a device the corrections run there ("stop" freezes ``eta``: ``torch.where``), so a
    call makes ``CORRECTIONS + RESCUES`` count passes and no host read. On the CPU,
    where reading a count waits for nothing, the loop stops at the first count inside the
    band (at least ``LOW * k`` in step 4), and a count settled in step 3 skips step 4: the
    ``eta`` a frozen loop ends with, from as few as one count pass. Under the DDP hook the
    payload has room for ``k``: of more, the largest go.

    Options:
        ratio: target density in (0, 1].

    Cost: one ``std_mean`` pass, ``abs``, a max pass, up to ``CORRECTIONS + RESCUES`` count
    passes (:func:`~gradsift.compressors.counts.count_above`), one selection pass
    (:func:`~gradsift.compressors.threshold.selection_with_maximum`, whose test passes every NaN
    and Inf element: the non-finite check).
    """

    name = "gaussiank"

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        k = target_count(flat.numel(), self.ratio)
        std, mean = torch.std_mean(flat, correction=0)
        eta = normal_two_sided_threshold(mean.abs(), std, self.ratio)
        assert isinstance(eta, torch.Tensor)  # of tensor moments
        magnitudes = flat.abs()
        cpu_branch = uses_numpy(flat)  # a count read there, through NumPy, waits for nothing
        for _ in range(CORRECTIONS):
            count = count_above(magnitudes, eta)
            if cpu_branch and LOW * k <= count.numpy() <= HIGH * k:
                break
            eta = torch.where(count < LOW * k, eta * 0.5, torch.where(count > HIGH * k, eta * 1.5, eta))
        else:  # no settled stop (a device never takes one): halve while too few pass
            for _ in range(RESCUES):
                count = count_above(magnitudes, eta)
                if cpu_branch and count.numpy() >= LOW * k:
                    break
                eta = torch.where(count < LOW * k, eta * 0.5, eta)
        return selection_with_maximum(flat, eta, magnitudes.max(), capacity)
