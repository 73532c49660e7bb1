"""SIDCo's sample of a gradient's magnitudes and the arithmetic on its counts.

The fitted threshold is checked on a strided sample of ``|g|`` (:func:`magnitude_sample`)
before it is applied: the sample's count above it against the count the target ratio
expects, in log space (:func:`log_miss`), read at two nearby thresholds for the
log-log slope (:func:`sample_slope`) that the multiplicative correction follows
(:mod:`gradsift.compressors.sidco`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradsift.compressors.stats import MagnitudeFit
from gradsift.compressors.tail_kernels import counts_above
from gradsift.core.payload import Count
from gradsift.core.precision import working_dtype
from gradsift.core.store import Canonical

_SLOPE_STEP = 0.1  # ln-eta offset at which the sample count is read for the slope
_SLOPE_RANGE = (0.5, 200.0)  # bounds on |d ln(count)/d ln(eta)|


def magnitude_sample(
    flat: torch.Tensor, size: int, call: int, canonical: Canonical | None = None
) -> torch.Tensor:
    """``|flat|`` at positions ``offset + j * stride``, ``stride = ceil(n / size)``.

    The sample spans the whole tensor (at most ``size`` elements; all of them when
    ``n <= size``). The offset is ``call mod stride``, so successive calls see
    different elements and a periodic layout cannot hide from the sample for long.
    With ``canonical`` (a DDP bucket laid out other than in parameter-number order) the
    positions are canonical ones, so the sample, in its order, is the same whatever layout
    DDP hands in (it changes with DDP's rebuild and when a run resumes): the parameters'
    strided views joined (:func:`canonical_strided`).
    Returned in :func:`gradsift.core.precision.working_dtype` (float32, or float64 for float64).
    """
    n = flat.numel()
    stride = -(-n // size)
    if canonical is not None and not canonical.identity:
        strided = canonical_strided(flat, canonical, call % stride, stride)
    else:
        strided = flat if stride == 1 else flat[call % stride :: stride]
    return strided.abs().to(working_dtype(flat.dtype))


def canonical_strided(flat: torch.Tensor, canonical: Canonical, first: int, stride: int) -> torch.Tensor:
    """``flat``'s elements at canonical positions ``first, first + stride, ...``, in that order:
    each parameter chunk's strided view, joined (one copy of the picked elements)."""
    pieces, views, start = flat.split(canonical.sizes), [], 0  # start: the chunk's canonical place
    for j in canonical.chunks:
        views.append(pieces[j][(first - start) % stride :: stride])
        start += canonical.sizes[j]
    return torch.cat(views)


def max_stage_count(ratio: float) -> int:
    """Largest stage count SIDCo uses for density ``ratio``: ``max(1, ceil(log2(1/ratio)))``."""
    return max(1, math.ceil(math.log2(1.0 / ratio) - 1e-12))


def sample_counts(sample: torch.Tensor, thresholds: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[#{s > t} for t in thresholds]`` as a float64 tensor (:func:`gradsift.compressors.tail_kernels.counts_above`)."""
    return counts_above(sample, list(thresholds))


def log_miss(count: torch.Tensor | Count, expected: float) -> torch.Tensor | float:
    """``ln((count + 1/2) / (expected + 1/2))``: how far a count is from its target, in log space."""
    if isinstance(count, torch.Tensor):
        return torch.log((count.double() + 0.5) / (expected + 0.5))
    return math.log((count + 0.5) / (expected + 0.5))


def device_threshold(fit: MagnitudeFit, ratio: float) -> torch.Tensor:
    """``fit``'s exceedance threshold for ``ratio``: a tensor, since the fit's fields are."""
    threshold = fit.exceedance_threshold(ratio)
    assert isinstance(threshold, torch.Tensor)  # fits of device moments have tensor fields
    return threshold


def correction_of(state: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The state's log correction as a float64 0-d tensor on ``device`` (a float before the first fit)."""
    correction = state["log_correction"]
    if isinstance(correction, torch.Tensor):
        return correction.to(device, torch.float64)
    return torch.full((), float(correction), dtype=torch.float64, device=device)


def slope_points(eta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The thresholds ``eta e^(-+0.1)`` at which the sample's log-log slope is read."""
    return eta * math.exp(-_SLOPE_STEP), eta * math.exp(_SLOPE_STEP)


def sample_slope(sample: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """``|d ln(count)/d ln(eta)|`` of the sample at ``eta`` (finite difference, bounded)."""
    below, above = sample_counts(sample, slope_points(eta))
    slope = torch.log((below + 0.5) / (above + 0.5)) / (2 * _SLOPE_STEP)
    return slope.clamp(*_SLOPE_RANGE)
