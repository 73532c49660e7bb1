"""Comparison kernels of the threshold sparsifiers and the fits: NumPy on CPU, PyTorch elsewhere.

On CPU, PyTorch's comparison kernels that produce a boolean tensor, ``nonzero`` and
``masked_select`` are 4-50x slower than NumPy's on the same memory (measured on the
project's 2-core machine, one thread, 2^20 fp32 elements: ``abs(x) > eta`` 630 us vs
NumPy 170 us, ``nonzero`` of the mask 1010 us vs ``flatnonzero`` 220 us; 2^18
elements, 25% kept: ``masked_select`` 9 ms vs ``np.compress`` 0.19 ms), and above
32768 elements each PyTorch kernel opens an OpenMP parallel region, which on an
oversubscribed CPU waits for a descheduled worker thread. NumPy runs these on the
calling thread, on a zero-copy view of the tensor. On other devices the PyTorch
kernels are used as they are.

:class:`CallingThreadOnly` is the same remedy for the PyTorch kernels a caller
cannot avoid (reductions over a sample): it runs a block with the intra-op pool at
one thread, so no kernel in it waits at a barrier. Gathers use ``index_select``:
advanced indexing ``x[indices]`` of 1% of a 2^19-element tensor took 16 ms with two
threads on the loaded machine (load ~20), ``index_select`` 7 us (one thread: 16 vs 5 us).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gradsift.errors import InvalidOptionError

#: Elements per chunk of the CPU selection: its two temporaries (the masked words and
#: the boolean mask, 1.25 MiB for fp32) stay in the core's 2 MiB L2 cache
#: (docs/decisions.md: 2^16-2^20 within 6% of each other, one chunk of 25M 1.7x slower).
SELECTION_CHUNK = 1 << 18

#: PyTorch's CPU kernels split their work over the intra-op pool only above this many
#: elements (``at::internal::GRAIN_SIZE``); on a busy machine (load ~20, 2 threads) one
#: read pass took 0.036 ms at 32768 elements and 16 ms at 65536, waiting for a thread.
PARALLEL_GRAIN = 32768

#: Integer dtype of the same width and the mask that clears the sign bit, per float dtype.
_MAGNITUDE_BITS = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
}


def select_above_threshold(flat: torch.Tensor, eta: float) -> torch.Tensor:
    """Indices ``i`` (int64, ascending) with ``|flat[i]| > eta`` or ``flat[i]`` NaN, for ``eta >= 0``.

    The comparison runs in ``flat``'s dtype (``eta`` is rounded to it). One read of
    ``flat``, in one of two ways:

    * CPU: the IEEE bit patterns of non-negative floats are ordered like the floats,
      so ``|x| > eta`` is ``(bits(x) & ~sign) > bits(eta)`` on the integer view --
      and NaN (exponent all ones, mantissa non-zero) lies above every finite
      ``eta``, so it is selected. NumPy evaluates that and ``flatnonzero`` over
      :data:`SELECTION_CHUNK`-element chunks on the calling thread.
    * other devices: ``nonzero(hardshrink(flat, eta))`` in one go (``hardshrink``
      keeps ``x`` where ``|x| > eta`` and NaN, and zeroes the rest).
    """
    if eta < 0:
        raise InvalidOptionError(f"eta must be >= 0, got {eta}")
    if not uses_numpy(flat):
        return torch.nonzero(F.hardshrink(flat, eta)).view(-1)
    integer, magnitude = _MAGNITUDE_BITS[flat.dtype]
    bound = int(torch.tensor(eta, dtype=flat.dtype, device="cpu").view(integer))  # a host scalar
    words = _numpy(flat.view(integer))
    if words.size <= SELECTION_CHUNK:
        return torch.from_numpy(np.flatnonzero((words & magnitude) > bound))
    pieces = []
    for start in range(0, words.size, SELECTION_CHUNK):
        positions = np.flatnonzero((words[start : start + SELECTION_CHUNK] & magnitude) > bound)
        positions += start
        pieces.append(positions)
    return torch.from_numpy(np.concatenate(pieces))


def uses_numpy(tensor: torch.Tensor) -> bool:
    """Whether these kernels run through NumPy for ``tensor``: on CPU, yes."""
    return tensor.device.type == "cpu"


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy NumPy view (``detach`` only when needed: it is one more dispatched operator)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def _numpy_floats(values: torch.Tensor) -> bool:
    """NumPy has the dtype (it has no bfloat16; float16 arithmetic there is slow): float32/float64 on CPU."""
    return uses_numpy(values) and values.dtype in (torch.float32, torch.float64)


def values_above(values: torch.Tensor, eta: float) -> torch.Tensor:
    """The elements of the 1-D ``values`` that are ``> eta``, in order (NaN is not kept)."""
    if not _numpy_floats(values):
        return torch.masked_select(values, values > eta)
    array = _numpy(values)
    return torch.from_numpy(np.compress(array > eta, array))


def counts_above(values: torch.Tensor, thresholds: Sequence[float]) -> list[int]:
    """``[#{v > t} for t in thresholds]`` for a 1-D ``values``.

    CPU: one NumPy compare-and-count per threshold. Elsewhere: one broadcast
    comparison with every threshold, one reduction and one host transfer.
    """
    if not _numpy_floats(values):
        bounds = torch.tensor(list(thresholds), dtype=values.dtype, device=values.device)
        return torch.gt(values.unsqueeze(1), bounds).sum(0).tolist()
    array = _numpy(values)
    return [int(np.count_nonzero(array > array.dtype.type(t))) for t in thresholds]


class CallingThreadOnly:
    """Run a ``with`` block with PyTorch's intra-op thread pool at one thread when ``device`` is the CPU.

    Restores the previous count afterwards (also on error). A no-op on other devices,
    when the pool already has one thread, and when ``largest`` (the most elements any
    kernel of the block reads) is at most :data:`PARALLEL_GRAIN`: such kernels never
    use the pool. Entering and leaving costs about 1 us, a no-op nothing measurable.
    """

    def __init__(self, device: torch.device, largest: int | None = None) -> None:
        small = largest is not None and largest <= PARALLEL_GRAIN
        self.previous = torch.get_num_threads() if device.type == "cpu" and not small else 1

    def __enter__(self) -> None:
        if self.previous > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc_info: object) -> None:
        if self.previous > 1:
            torch.set_num_threads(self.previous)
