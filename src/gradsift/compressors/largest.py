"""The ``k`` largest magnitudes of a gradient: one ``topk`` on a device, a radix select on CPU.

On CPU the magnitudes are ordered by their bit patterns: a float's bits with the sign
cleared, read as an integer, order like its magnitude, with Inf above every number and
NaN above Inf (:data:`~gradsift.compressors.kernels.MAGNITUDE_BITS`). The ``k``-th largest
pattern is found a digit of up to :data:`RADIX_BITS` bits at a time, from the top: one
pass counts the elements per digit value (NumPy's ``bincount``) among those that share
the digits found so far, and the digit where the count from the top reaches ``k`` is the
threshold's. Every element above the threshold is then selected, and of those equal to
it the first ones in position order (ties to the lower position, the order
:func:`~gradsift.compressors.kernels.ranking_keys` gives), ``k`` in all. Every pass reads
the tensor in chunks of :data:`RADIX_CHUNK` elements on the calling thread (two counting
passes and the selection's for fp32, one and the selection's for fp16/bf16, four and the
selection's for fp64), so the temporaries are a chunk's, the counts' and the ``k``
positions', never a value and a position per element read, which PyTorch's CPU ``topk``
holds (docs/decisions.md).
"""

from __future__ import annotations

import numpy as np
import torch

from gradsift.compressors.kernels import MAGNITUDE_BITS, numpy_view, uses_numpy

#: Widest digit of the CPU radix select: ``2^16`` counts per pass.
RADIX_BITS = 16

#: Elements per chunk of the CPU radix select's passes (NumPy's ``bincount`` widens a
#: chunk's digits to int64: with the chunk's patterns, 12 bytes per element of a chunk).
RADIX_CHUNK = 1 << 16

#: Up to this many elements the CPU takes one ``topk`` (its pairs are then at most this many).
ONE_TOPK_BELOW = 1 << 17


def largest_magnitudes(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(magnitudes, indices)`` of the ``k`` largest ``|flat|`` (NaN above every number), in
    no particular order (``0 < k <= flat.numel()``).

    Device, a CPU tensor of fewer than :data:`ONE_TOPK_BELOW` elements, or a dtype without
    bit patterns here: one ``topk`` of ``|flat|``. Else the radix select of the module
    docstring, ties to the lower position; the indices come ascending.
    """
    if not uses_numpy(flat) or flat.numel() < ONE_TOPK_BELOW or flat.dtype not in MAGNITUDE_BITS:
        found = torch.topk(flat.abs(), k, sorted=False)
        return found.values, found.indices
    integer, magnitude = MAGNITUDE_BITS[flat.dtype]
    words = numpy_view(flat.view(integer))
    threshold, ties = _kth_largest(words, magnitude, magnitude.bit_length(), k)
    indices = torch.from_numpy(_at_or_above(words, magnitude, threshold, ties))
    return flat.index_select(0, indices).abs(), indices


def _kth_largest(words: np.ndarray, magnitude: int, bits: int, k: int) -> tuple[int, int]:
    """``(t, ties)``: the ``k``-th largest magnitude pattern ``t`` of ``words`` and how many of the
    elements equal to it the ``k`` largest take."""
    prefix, shift, need = 0, bits, k
    buffer = np.empty(min(RADIX_CHUNK, words.size), dtype=words.dtype)
    while shift > 0:
        width = min(RADIX_BITS, shift)
        shift -= width
        counts = np.zeros(1 << width, dtype=np.int64)
        for start in range(0, words.size, RADIX_CHUNK):
            piece = words[start : start + RADIX_CHUNK]
            patterns = np.bitwise_and(piece, magnitude, out=buffer[: piece.size])
            if shift + width < bits:  # only those that share the digits found so far
                low = prefix << (shift + width)
                patterns = patterns[(patterns >= low) & (patterns < low + (1 << (shift + width)))]
                np.bitwise_and(patterns, (1 << (shift + width)) - 1, out=patterns)
            counts += np.bincount(np.right_shift(patterns, shift, out=patterns), minlength=1 << width)
        from_top = np.cumsum(counts[::-1])[::-1]  # from_top[d]: elements with a digit >= d
        digit = int(np.flatnonzero(from_top >= need)[-1])
        need -= int(from_top[digit + 1]) if digit + 1 < from_top.size else 0
        prefix = (prefix << width) | digit
    return prefix, need


def _at_or_above(words: np.ndarray, magnitude: int, threshold: int, ties: int) -> np.ndarray:
    """Positions (int64, ascending) of every pattern above ``threshold`` and of the first
    ``ties`` equal to it."""
    pieces = []
    buffer = np.empty(min(RADIX_CHUNK, words.size), dtype=words.dtype)
    for start in range(0, words.size, RADIX_CHUNK):
        piece = words[start : start + RADIX_CHUNK]
        patterns = np.bitwise_and(piece, magnitude, out=buffer[: piece.size])
        chosen = patterns > threshold
        if ties:
            equal = np.flatnonzero(patterns == threshold)[:ties]
            chosen[equal] = True
            ties -= equal.size
        found = np.flatnonzero(chosen)
        found += start
        pieces.append(found)
    positions = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return positions.astype(np.int64, copy=False)
