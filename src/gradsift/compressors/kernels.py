"""Selection kernels of the sparsifiers: NumPy on CPU, PyTorch (without host reads) elsewhere.

Two jobs (the statistics of a sample's tail that the fitted thresholds need are
:mod:`gradsift.compressors.tail_kernels`', on the same two branches; the top-k's ``k``
largest magnitudes of a whole tensor :mod:`gradsift.compressors.largest`'s):

* **Selecting** the elements of a gradient that pass a test (``|g| > eta``, or any boolean
  mask) as positions. On CPU, PyTorch's comparison kernels that produce a boolean tensor
  and ``nonzero`` are several times slower than NumPy's on the same memory (docs/decisions.md),
  and above 32768 elements each PyTorch kernel opens an OpenMP parallel region, which on
  an oversubscribed CPU waits for a descheduled worker thread. NumPy runs these on the
  calling thread, on a zero-copy view of the tensor, and the number of selected
  elements is known on the host at no cost: CPU memory *is* host memory. On other
  devices the number of selected elements is data the host does not have, and asking
  for it (``nonzero``) stalls the device.
* **Keeping the largest** of the selected elements when a payload has a capacity: the
  ``capacity`` largest magnitudes, in position order, ties to the lower position (one
  total order, :func:`ranking_keys`, on every device). On CPU the selected positions are
  compacted first (host-sized) and the largest of them kept (:func:`keep_largest`);
  elsewhere one ``topk`` of ``capacity`` over the ranking keys of the whole tensor, the
  unselected elements keyed -1 -- fixed shapes, no host read, and the same elements.

Each function has two branches, chosen by :func:`uses_numpy` (:func:`numpy_floats` where
NumPy must hold the dtype): the CPU branch and the device branch. Under :func:`device_branch` the device branch runs on CPU tensors too, so a test
can compare the two on the same bucket.

:class:`CallingThreadOnly` runs a block with the intra-op pool at one thread (the
remedy for the PyTorch kernels on CPU a caller cannot avoid). Gathers use
``index_select``, far cheaper than advanced indexing ``x[indices]`` on a loaded machine
(docs/decisions.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import numpy as np
import torch

from gradsift.compressors.radix import largest_positions
from gradsift.core.errors import InvalidOptionError
from gradsift.core.finite import nonfinite

#: Elements per chunk of the CPU selection: its two temporaries (the masked words and
#: the boolean mask, 1.25 MiB for fp32) stay in the core's 2 MiB L2 cache (the chunk sizes
#: measured: docs/decisions.md, "Comparison kernels on CPU run in NumPy, on the calling thread").
SELECTION_CHUNK = 1 << 18

#: With a capacity, the CPU selection collects the positions of at most this many times the
#: capacity (:func:`select_above`); past that it counts, then takes the largest by a radix select.
COLLECTED_PER_CAPACITY = 2

#: PyTorch's CPU kernels split their work over the intra-op pool only above this many
#: elements (``at::internal::GRAIN_SIZE``); on a busy machine a pass above it waits for a pool
#: thread (measured: docs/decisions.md, "Busy-CPU costs outside SIDCo's fits").
PARALLEL_GRAIN = 32768

#: Integer dtype of the same width and the mask that clears the sign bit, per float dtype.
MAGNITUDE_BITS = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
}

Threshold = float | torch.Tensor


class Candidates(NamedTuple):
    """Selected positions.

    Attributes:
        indices: int64 positions, ascending over the first ``length`` (padding: 0).
        length: positions in use (None: all of ``indices``).
        selected: how many elements passed the test (``>= length``; a host int on CPU).
        nonfinite: 0-d bool, some element of the tested tensor is NaN or Inf (only for
            :func:`select_above`, whose test selects every NaN and Inf; else None).
    """

    indices: torch.Tensor
    length: int | torch.Tensor | None
    selected: int | torch.Tensor
    nonfinite: torch.Tensor | None = None


_DEVICE_BRANCH: ContextVar[bool] = ContextVar("gradsift_device_branch", default=False)


def uses_numpy(tensor: torch.Tensor) -> bool:
    """Whether these kernels run through NumPy for ``tensor``: on CPU, yes (outside
    :func:`device_branch`)."""
    return tensor.device.type == "cpu" and not _DEVICE_BRANCH.get()


@contextlib.contextmanager
def device_branch() -> Iterator[None]:
    """Run every kernel's device branch, CPU tensors included, inside the ``with`` block (for
    tests that compare it with the CPU branch on the same data)."""
    token = _DEVICE_BRANCH.set(True)
    try:
        yield
    finally:
        _DEVICE_BRANCH.reset(token)


def select_above(flat: torch.Tensor, eta: Threshold, capacity: int | None = None) -> Candidates:
    """Positions ``i`` with ``|flat[i]| > eta`` or ``flat[i]`` NaN or Inf (``eta >= 0``), ascending;
    with ``capacity``, the at most ``capacity`` largest of them (:func:`select_mask`).

    The comparison runs in ``flat``'s dtype (``eta`` is rounded to it). NaN and Inf always
    pass the test, whatever ``eta`` is: an ``eta`` that is NaN or Inf in the dtype -- a
    threshold estimated from data that held a NaN or an Inf, such as a sampled quantile or a
    fit -- is compared as the dtype's largest finite value, so the NaN and Inf elements pass
    and no finite one does. So ``nonfinite`` -- read from the selected elements only --
    checks all of them; ``selected`` counts every element that passed, whatever the capacity.

    * CPU: the IEEE bit patterns of non-negative floats are ordered like the floats,
      so ``|x| > eta`` is ``(bits(x) & ~sign) > (bits(eta) & ~sign)`` on the integer view --
      and NaN (exponent all ones, mantissa non-zero) and Inf lie above the largest finite
      pattern, at which the bound is capped. NumPy evaluates that and ``flatnonzero`` over
      :data:`SELECTION_CHUNK`-element chunks on the calling thread. With a capacity, once
      more than :data:`COLLECTED_PER_CAPACITY` times it passed, the rest is only counted,
      and the capacity largest are those of the whole tensor
      (:func:`~gradsift.compressors.radix.largest_positions`: everything that passed lies
      above everything that did not, and the order is :func:`keep_largest`'s), so the
      positions held stay a multiple of the capacity whatever ``eta`` lets through.
    * device: the mask ``not (|x| <= eta)`` (true for NaN) against ``eta`` in the dtype, NaN or
      Inf replaced by the largest finite value (on the host for a number; for a tensor, one
      operation on it where it is: no host read, no copy to the device),
      :func:`~gradsift.core.finite.nonfinite` of the selected values and :func:`select_mask`'s
      device branch.
    """
    if uses_numpy(flat):
        found = _select_above_numpy(flat, eta, capacity)
        if capacity is None or found.length is not None:  # no capacity, or cut to it already
            return found
        indices, length = keep_largest(flat, found, capacity)
        return found._replace(indices=indices, length=length)
    if isinstance(eta, float) and eta < 0:
        raise InvalidOptionError(f"eta must be >= 0, got {eta}")
    largest = torch.finfo(flat.dtype).max
    bound: Threshold  # eta, NaN or Inf in the dtype made the largest: where eta is, never copied
    if isinstance(eta, torch.Tensor):
        bound = torch.nan_to_num(eta.to(flat.dtype), nan=largest, posinf=largest)
    else:  # a number above the largest rounds to it or to Inf; NaN fails the test too
        bound = eta if eta <= largest else largest
    mask = ~(flat.abs() <= bound)
    candidates = select_mask(mask, capacity, flat)
    return candidates._replace(nonfinite=nonfinite(torch.where(mask, flat, 0)))


def _select_above_numpy(flat: torch.Tensor, eta: Threshold, capacity: int | None) -> Candidates:
    integer, magnitude = MAGNITUDE_BITS[flat.dtype]
    threshold = host_float(eta)
    if threshold < 0:
        raise InvalidOptionError(f"eta must be >= 0, got {threshold}")
    bits = int(
        torch.tensor(threshold, dtype=flat.dtype, device="cpu").view(integer).numpy()
    )  # eta in the dtype
    bound = min(bits & magnitude, _infinity_bits(flat.dtype) - 1)  # NaN and Inf above it, whatever eta is
    words = numpy_view(flat.view(integer))
    limit = None if capacity is None else COLLECTED_PER_CAPACITY * capacity
    pieces, largest, count = [], -1, 0  # largest selected magnitude pattern (-1: none selected)
    # a chunk's patterns and test in two buffers made once per call, not once per chunk
    patterns = np.empty(min(SELECTION_CHUNK, words.size), dtype=words.dtype)
    tested = np.empty(patterns.size, dtype=bool)
    for start in range(0, words.size, SELECTION_CHUNK):
        chunk = words[start : start + SELECTION_CHUNK]
        magnitudes = np.bitwise_and(chunk, magnitude, out=patterns[: chunk.size])
        above = np.greater(magnitudes, bound, out=tested[: chunk.size])
        if limit is not None and count > limit:  # past the limit: counted, not collected
            passed = int(np.count_nonzero(above))
            largest = max(largest, int(magnitudes.max())) if passed else largest
            count += passed
            continue
        piece = np.flatnonzero(above)
        if piece.size:  # read while the chunk is in cache, not gathered from the tensor later
            largest = max(largest, int(magnitudes[piece].max()))
            piece += start
        pieces.append(piece)
        count += piece.size
    flagged = torch.tensor(largest >= _infinity_bits(flat.dtype), device="cpu")
    if capacity is not None and limit is not None and count > limit:  # all that passed lie above the rest
        indices = torch.from_numpy(largest_positions(words, magnitude, capacity))
        return Candidates(indices, capacity, count, flagged)
    positions = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return Candidates(torch.from_numpy(positions.astype(np.int64, copy=False)), None, count, flagged)


def select_mask(
    mask: torch.Tensor, capacity: int | None = None, magnitudes_of: torch.Tensor | None = None
) -> Candidates:
    """Positions of the True elements of the 1-D boolean ``mask``, ascending; with ``capacity``,
    the at most ``capacity`` of them of largest ``|magnitudes_of|`` (NaN largest, ties to the
    lower position), as exactly ``capacity`` positions, the first ``length`` in use.

    CPU: every position (NumPy), count on the host, then :func:`keep_largest`. Device:
    without ``capacity`` every position (``nonzero``: a host read, for callers off the hot
    path); with it, ``topk`` of ``capacity`` over the :func:`ranking_keys` of the whole
    tensor with the unselected elements keyed -1, the picked positions sorted (no host
    read; ``selected`` a device scalar). Both branches pick the same elements.
    """
    if capacity is not None and magnitudes_of is None:
        raise InvalidOptionError("select_mask with a capacity needs magnitudes_of")
    if uses_numpy(mask):
        positions = np.flatnonzero(numpy_view(mask))
        found = Candidates(
            torch.from_numpy(positions.astype(np.int64, copy=False)), None, int(positions.size)
        )
        if capacity is None:
            return found
        assert magnitudes_of is not None
        indices, length = keep_largest(magnitudes_of, found, capacity)
        return found._replace(indices=indices, length=length)
    if capacity is None:
        indices = torch.nonzero(mask).view(-1)
        return Candidates(indices, None, indices.numel())
    assert magnitudes_of is not None
    keys = torch.where(mask, ranking_keys(magnitudes_of), -1)
    top = torch.topk(keys, min(capacity, keys.numel()), sorted=False)
    chosen, used = _in_position_order(top.indices, _ranked(top.values), capacity)
    return Candidates(chosen, used, mask.sum())


def candidate_positions(mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(positions, live)`` of the True elements of the 1-D ``mask``, for work on just those.

    CPU: their positions (host-sized, ascending) and no mask. Device: no positions (every
    element takes part: their number is not known on the host) and ``mask`` as the live mask.
    """
    if uses_numpy(mask):
        return torch.from_numpy(np.flatnonzero(numpy_view(mask)).astype(np.int64, copy=False)), None
    return None, mask


#: Position bits of a ranking key (see :func:`ranking_keys`).
_POSITION_BITS = 32


def ranking_keys(values: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys that order elements by ``|value|`` (NaN above Inf), ties to the lower position.

    ``key = bits(|v|) << 32 | (2^32 - 1 - position)`` for 16- and 32-bit floats with fewer
    than 2^32 elements: the magnitude's bit pattern (sign cleared) orders like the
    magnitude, and the complemented position breaks ties, so the keys are distinct and
    every ``topk`` of them -- on any device, of any subset -- picks the same elements.
    ``positions`` are the elements' positions (default: ``0 .. n-1``). Other dtypes and
    sizes: the magnitudes themselves (ties then left to ``topk``).
    """
    count = values.numel()
    if positions is None:
        positions = torch.arange(count, device=values.device)
    if values.dtype not in (torch.float16, torch.bfloat16, torch.float32) or count >= 1 << _POSITION_BITS:
        return values.abs()
    integer, magnitude = MAGNITUDE_BITS[values.dtype]
    bits = (values.view(integer) & magnitude).to(torch.int64)
    return (bits << _POSITION_BITS) | ((1 << _POSITION_BITS) - 1 - positions)


def _ranked(keys: torch.Tensor) -> torch.Tensor:
    """Which picked keys stand for an element (the others were keyed -1; a NaN magnitude,
    where the keys are the magnitudes themselves, is an element)."""
    return (keys >= 0) | torch.isnan(keys) if keys.is_floating_point() else keys >= 0


def _in_position_order(
    picked: torch.Tensor, valid: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, length)``: the ``valid`` ones of the positions ``picked`` ascending, then 0s,
    ``capacity`` entries in all, and how many are in use."""
    ordered = torch.sort(torch.where(valid, picked, torch.iinfo(torch.int64).max)).values
    used = valid.sum()
    ordered = torch.where(torch.arange(ordered.numel(), device=ordered.device) < used, ordered, 0)
    if ordered.numel() < capacity:
        ordered = torch.cat([ordered, ordered.new_zeros(capacity - ordered.numel())])
    return ordered, used


def nonzero_first(
    indices: torch.Tensor, magnitudes: torch.Tensor, smallest: torch.Tensor
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """``indices`` (ascending) with those of zero magnitude moved out: ``(positions, length)``,
    the first ``length`` the non-zero ones in order, the rest 0 (``smallest``: the least of
    ``magnitudes``).

    CPU: when ``smallest > 0`` (the usual case, one read of CPU memory) ``indices`` as they
    are; otherwise, and on other devices, a sort with the zeros last.
    """
    if uses_numpy(smallest) and host_float(smallest) > 0:
        return indices, indices.numel()
    nonzero = magnitudes > 0
    ordered = torch.sort(torch.where(nonzero, indices, torch.iinfo(torch.int64).max)).values
    length = nonzero.sum()
    return torch.where(torch.arange(indices.numel(), device=indices.device) < length, ordered, 0), length


def keep_largest(
    magnitudes_of: torch.Tensor, candidates: Candidates, capacity: int
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """The at most ``capacity`` candidates of largest ``|magnitudes_of[i]|``, in position order.

    Returns ``(indices, length)``: exactly ``capacity`` int64 positions, the first
    ``length`` in use and ascending, the rest 0. The order is :func:`ranking_keys`' (NaN
    largest, so a non-finite element that was selected stays selected; ties to the lower
    position), the same as :func:`select_mask`'s device branch.

    The candidates are ascending, so on CPU, with every candidate in use, flagging the
    picked ones and compacting the candidates (NumPy, one pass over ``found`` flags) puts
    them in position order without a sort (docs/decisions.md). Elsewhere the compacted
    size would be a host read, so the picked positions are sorted.
    """
    indices, length = candidates.indices, candidates.length
    found = indices.numel()
    if length is None and found <= capacity:
        if found == capacity:
            return indices, found
        return torch.cat([indices, indices.new_zeros(capacity - found)]), found
    keys = ranking_keys(magnitudes_of.index_select(0, indices), indices)
    in_use = None if length is None else torch.arange(found, device=indices.device) < length
    if in_use is not None:
        keys = torch.where(in_use, keys, -1)
    top = torch.topk(keys, min(capacity, found), sorted=False)
    if length is None and uses_numpy(indices):  # every candidate in use: compact, in order
        chosen_flags = np.zeros(found, dtype=np.bool_)
        chosen_flags[numpy_view(top.indices)] = True
        return torch.from_numpy(np.compress(chosen_flags, numpy_view(indices))), capacity
    return _in_position_order(indices.index_select(0, top.indices), _ranked(top.values), capacity)


def zero_at(tensor: torch.Tensor, indices: torch.Tensor, used: torch.Tensor | None) -> None:
    """``tensor[indices[used]] = 0`` in place, without a host read: ``index_add_`` of minus
    the values there, so a padding entry (index 0, not in use) adds 0 even when index 0
    is also a real entry, and a position given twice is zeroed once."""
    found = tensor.index_select(0, indices)
    if used is not None:
        found = torch.where(used, found, 0)
    tensor.index_add_(0, indices, found, alpha=-1)


def host_float(value: Threshold) -> float:
    """A CPU threshold as a Python float (CPU memory: no device to wait for); the CPU branches' own."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    return float((value if numpy_floats(value) else value.to(torch.float64)).numpy())


def numpy_floats(values: torch.Tensor) -> bool:
    """NumPy has the dtype (it has no bfloat16; float16 arithmetic there is slow): float32/float64 on CPU."""
    return uses_numpy(values) and values.dtype in (torch.float32, torch.float64)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy NumPy view (``detach`` only when needed: it is one more dispatched operator)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def _infinity_bits(dtype: torch.dtype) -> int:
    """The bit pattern of +Inf in ``dtype``: every magnitude pattern at or above it is Inf or NaN."""
    integer, _ = MAGNITUDE_BITS[dtype]
    return int(torch.tensor(float("inf"), dtype=dtype, device="cpu").view(integer).numpy())


class CallingThreadOnly:
    """Run a ``with`` block with PyTorch's intra-op thread pool at one thread when ``device`` is the CPU.

    Restores the previous count afterwards (also on error). A no-op on other devices,
    when the pool already has one thread, and when ``largest`` (the most elements any
    kernel of the block reads) is at most :data:`PARALLEL_GRAIN`: such kernels never
    use the pool. Entering and leaving costs next to nothing; a no-op, nothing measurable.
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
