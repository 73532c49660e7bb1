"""DGC (Lin et al. 2018): a threshold estimated on a random sample, then exact top-k if it over-selects."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors import draws
from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.draws import stream_seed
from gradsift.compressors.kernels import Candidates, keep_largest
from gradsift.compressors.threshold import threshold_selection
from gradsift.core.errors import InvalidOptionError
from gradsift.core.readout import Readout
from gradsift.core.validation import check_int, check_real

#: Over-selection bound of the paper: above ``OVER * k`` selected elements, DGC runs top-k on them.
OVER = 4 / 3


class DGC(Sparsifier):
    """Deep Gradient Compression's sparsifier.

    For a flat gradient ``g`` of ``n`` elements and ``k = max(1, floor(n * ratio))``:

    1. Draw ``s = min(n, max(min_sample, ceil(n * sample_ratio)))`` positions
       uniformly (with replacement), a function of ``(seed, key, call)`` -- the same on
       every device (:mod:`gradsift.compressors.draws`) and, in a DDP bucket, over its
       parameters in number order (:meth:`gradsift.core.store.TensorStore.canonical`), so
       DDP's layout does not change the sample; ``a = |g|`` there.
    2. ``eta`` = the smallest of the ``ceil(s * ratio)`` largest sampled magnitudes.
    3. Select ``{i : |g_i| >= eta}`` (count ``c``; ties at ``eta`` included, so a
       constant tensor is never left unsent).
    4. If ``c > 4/3 k``: the exact top-k among the selected (DGC's hierarchical top-k).
       Under the DDP hook the payload has room for ``k``, so there any ``c > k`` is cut
       to the ``k`` largest (the rest waits in error feedback). Fewer than ``k`` (the
       sample missed the tail) are sent as they are: an exact top-k over all of ``|g|``
       in that case would need the count on the host, which a GPU only has after a stall.

    DGC's momentum correction and momentum factor masking are error-feedback
    concerns: use :class:`gradsift.hook.feedback.ErrorFeedback` with ``momentum=m``
    (and an optimizer without momentum). Local gradient clipping and density
    warm-up belong to the training loop.

    Options:
        ratio: target density in (0, 1].
        sample_ratio: fraction of ``n`` sampled, in (0, 1] (default 0.01).
        min_sample: smallest sample size, integer >= 1 (default 1024).
        seed: seed of the sample's draws, integer >= 0 (default 0).

    State (``state_dict``): the per-key call counters (the sample of call ``t`` of
    ``key`` is fixed by ``(seed, key, t)``).

    Cost: one comparison pass over ``n`` (:func:`gradsift.compressors.kernels.select_above`), a
    top-k over the sample (and over ``c`` elements when trimming); the non-finite check
    reads only the selected values: the comparison selects every NaN and Inf, also when one
    fell in the sample and made ``eta`` NaN or Inf (then it selects only those).
    """

    name = "dgc"

    def __init__(
        self, ratio: float = 0.01, sample_ratio: float = 0.01, min_sample: int = 1024, seed: int = 0
    ) -> None:
        super().__init__(ratio)
        self.sample_ratio = check_real(sample_ratio, "sample_ratio", low=0.0, high=1.0, low_open=True)
        self.min_sample = check_int(min_sample, "min_sample", low=1)
        self.seed = check_int(seed, "seed", low=0)
        self.calls: dict[Hashable, int] = {}

    def options(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "sample_ratio": self.sample_ratio,
            "min_sample": self.min_sample,
            "seed": self.seed,
        }

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        n = flat.numel()
        k = target_count(n, self.ratio)
        size = min(n, max(self.min_sample, math.ceil(n * self.sample_ratio)))
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        positions = draws.below(n, stream_seed(self.seed, key, call), size, flat.device)
        canonical = self.store.canonical(key)
        if canonical is not None:  # drawn in parameter order: a rebuilt bucket samples the same elements
            positions = canonical.flat_positions(positions)
        top = torch.topk(
            flat.index_select(0, positions).abs(), math.ceil(size * self.ratio), sorted=False
        ).values
        eta = top.min()
        # ">= eta": the comparison is strict, so a hair below eta (in the gradient's dtype)
        # -- ties at eta (a constant tensor) are selected and cut to k, never left to stall
        selection = threshold_selection(flat, eta - eta.abs() * torch.finfo(flat.dtype).eps, capacity)
        if capacity is None and selection.indices.numel() > OVER * k:  # compress(): host-sized
            indices, _ = keep_largest(flat, Candidates(selection.indices, None, selection.indices.numel()), k)
            return selection._replace(indices=indices)
        return selection

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"calls"}:
            raise InvalidOptionError(f"{self.name} state must hold the key calls; got {sorted(state)}")
        self.calls = {key: check_int(call, f"calls[{key!r}]", low=0) for key, call in state["calls"].items()}
