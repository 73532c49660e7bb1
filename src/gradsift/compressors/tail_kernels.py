"""Statistics of a sample's tail for the fitted thresholds (SIDCo): NumPy on CPU, PyTorch elsewhere.

Sums, counts and quantiles of the elements above a bound, on the two branches of
:mod:`gradsift.compressors.kernels` (:func:`~gradsift.compressors.kernels.numpy_floats`: the CPU
branch reads the tensor through a zero-copy NumPy view on the calling thread; the device
branch masks every element and makes no host read). Each returns tensors, float64 where it
sums, so a caller's arithmetic is the same on either branch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradsift.compressors.kernels import Threshold, host_float, numpy_floats, numpy_view


def moment_sums(
    values: torch.Tensor, above: Threshold | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(count, sum, sum of squares, minimum)`` of the elements of the 1-D ``values`` that are
    ``> above`` (all of them without ``above``), as float64 0-d tensors on ``values``' device;
    the minimum of none is +inf.

    CPU: NumPy keeps the elements above the bound (``np.compress``, on the calling thread;
    no copy when all of them are, as in SIDCo's stages, whose values were already narrowed
    to that bound) and sums that tail in float64 -- SIDCo's later
    stages see a few percent of the sample.
    The sum of squares is ``np.einsum``, never ``np.dot``: NumPy hands a dot product to
    BLAS, whose worker threads spin against the other ranks on a shared CPU (einsum runs on
    the calling thread; docs/decisions.md has the times).
    Other devices: masked sums over every element, no host read.
    """
    if numpy_floats(values):
        array = numpy_view(values)
        passes = None if above is None else array > host_float(above)
        tail = array if passes is None or passes.all() else np.compress(passes, array)
        wide = tail.astype(np.float64)
        smallest = float(tail.min()) if tail.size else math.inf
        count, total, squares, least = torch.tensor(
            [float(wide.size), float(wide.sum()), float(np.einsum("i,i->", wide, wide)), smallest],
            dtype=torch.float64,
            device="cpu",
        ).unbind()
        return count, total, squares, least
    x = values.reshape(-1)
    if above is None:
        kept = x.double()
        count = torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)
        least = kept.min() if x.numel() else count + math.inf
    else:
        mask = x > above
        kept = torch.where(mask, x, 0).double()
        count = mask.sum(dtype=torch.float64)
        least = torch.where(mask, x, math.inf).min().double() if x.numel() else count + math.inf
    return count, kept.sum(), torch.dot(kept, kept), least


def narrowed(values: torch.Tensor, bound: Threshold) -> torch.Tensor:
    """Elements of the 1-D ``values`` that the bound cannot rule out: on CPU those ``> bound``
    (NumPy, host-sized for free), elsewhere all of them (masking them costs no host read)."""
    if numpy_floats(values):
        array = numpy_view(values)
        return torch.from_numpy(np.compress(array > host_float(bound), array))
    return values


def counts_above(values: torch.Tensor, thresholds: list[torch.Tensor]) -> torch.Tensor:
    """``[#{v > t} for t in thresholds]`` as a float64 tensor (compared in ``values``' dtype).

    CPU: one NumPy compare-and-count per threshold. Elsewhere: one broadcast comparison with
    every threshold and one reduction, no host read.
    """
    if numpy_floats(values):
        array = numpy_view(values)
        kind = array.dtype.type
        counts = [float(np.count_nonzero(array > kind(host_float(t)))) for t in thresholds]
        return torch.tensor(counts, dtype=torch.float64, device="cpu")
    bounds = torch.stack([t.to(values.dtype) for t in thresholds])
    return torch.gt(values.unsqueeze(1), bounds).sum(0, dtype=torch.float64)


def value_with_above(values: torch.Tensor, keep: int) -> torch.Tensor:
    """The element of the 1-D ``values`` with exactly ``keep`` elements above it: the
    ``(keep+1)``-th largest (ties may leave fewer above it), a 0-d tensor.

    CPU: NumPy's introselect (``np.partition``: linear time, no tensor of positions). Elsewhere:
    ``torch.topk`` of ``keep + 1``, no host read.
    """
    if numpy_floats(values):
        array = numpy_view(values)
        position = array.size - 1 - keep
        return torch.tensor(float(np.partition(array, position)[position]), dtype=values.dtype, device="cpu")
    return torch.topk(values, keep + 1, sorted=False).values.min()


def kept_or_value_with_above(
    keep_eta: torch.Tensor, eta: torch.Tensor, values: torch.Tensor, keep: int
) -> torch.Tensor:
    """``eta`` where the 0-d bool ``keep_eta`` holds, else :func:`value_with_above` of
    ``(values, keep)`` (in ``eta``'s dtype).

    CPU: the flag is host memory (read through NumPy), so the selection of the quantile
    runs only when it is needed -- SIDCo's sample check keeps ``eta`` on most calls, and
    the partition is a copy and a pass over the sample. Elsewhere: both, chosen on the
    device by ``torch.where``, no host read.
    """
    if numpy_floats(values) and keep_eta.device.type == "cpu":
        if bool(numpy_view(keep_eta.reshape(1))[0]):
            return eta
        return value_with_above(values, keep).to(eta.dtype)
    return torch.where(keep_eta, eta, value_with_above(values, keep).to(eta.dtype))
