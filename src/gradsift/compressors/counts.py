"""The count pass of the searched thresholds (RedSync's bracket, GaussianK's corrections):
how many magnitudes lie above a threshold, without a full-size mask on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from gradsift.compressors.kernels import SELECTION_CHUNK, numpy_floats, numpy_view


def count_above(values: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """``#{i : values[i] > eta}`` (NaN counts nowhere), a 0-d int64 tensor on ``values``' device.

    On a device, or for a dtype NumPy lacks here: ``count_nonzero`` of the comparison, no host
    read. CPU float32/float64: NumPy over chunks of :data:`SELECTION_CHUNK` into one boolean
    buffer made once per call, ``eta`` in the values' dtype (torch compares a 0-d tensor in the
    other operand's dtype) -- no full-size mask, and no widening of one to sum it.
    """
    if not numpy_floats(values):
        return torch.count_nonzero(values > eta)
    threshold = eta.to(values.dtype).numpy()
    array = numpy_view(values)
    tested = np.empty(min(SELECTION_CHUNK, array.size), dtype=bool)
    total = 0
    for start in range(0, array.size, SELECTION_CHUNK):
        chunk = array[start : start + SELECTION_CHUNK]
        total += int(np.count_nonzero(np.greater(chunk, threshold, out=tested[: chunk.size])))
    return torch.tensor(total, device="cpu")  # the NumPy branch runs on CPU tensors only
