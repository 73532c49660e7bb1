"""Radix select on magnitude bit patterns, in NumPy: the ``k`` largest of a tensor's magnitudes.

A float's bits with the sign cleared, read as an integer, order like its magnitude, with
Inf above every number and NaN above Inf. :func:`kth_largest` finds the ``k``-th largest
such pattern a digit of up to :data:`RADIX_BITS` bits at a time, from the top: one pass
counts the elements per digit value (``np.add.at``, into the counts in place) among those
that share the digits found so far, the counts are summed from the top digit down (a
cumulative sum in place), and the digit where the sum reaches ``k`` is the threshold's.
:func:`at_or_above` then takes every element above the threshold and, of those equal to it,
the first ones in position order (ties to the lower position), ``k`` in all. Every pass
reads the words in chunks of :data:`RADIX_CHUNK` on the calling thread, so the temporaries
are a chunk's, the counts' and the ``k`` positions'.
"""

from __future__ import annotations

import numpy as np

#: Widest digit: ``2^16`` counts per pass.
RADIX_BITS = 16

#: Elements per chunk of a pass: its temporaries are the chunk's patterns (and, past the
#: first pass, the masks that pick and the patterns that share the digits found so far).
RADIX_CHUNK = 1 << 15


def largest_positions(words: np.ndarray, magnitude: int, k: int) -> np.ndarray:
    """Positions (int64, ascending) of the ``k`` largest ``words & magnitude`` (``0 < k <= words.size``;
    ``magnitude`` the mask that clears the sign bit), ties to the lower position."""
    threshold, ties = kth_largest(words, magnitude, magnitude.bit_length(), k)
    return at_or_above(words, magnitude, threshold, ties)


def kth_largest(words: np.ndarray, magnitude: int, bits: int, k: int) -> tuple[int, int]:
    """``(t, ties)``: the ``k``-th largest magnitude pattern ``t`` of ``words`` and how many of the
    elements equal to it the ``k`` largest take."""
    prefix, shift, need = 0, bits, k
    buffer = np.empty(min(RADIX_CHUNK, words.size), dtype=words.dtype)
    while shift > 0:
        width = min(RADIX_BITS, shift)
        shift -= width
        top = (1 << width) - 1
        from_top = np.zeros(top + 1, dtype=np.int64)  # counts per digit, the top digit first
        for start in range(0, words.size, RADIX_CHUNK):
            piece = words[start : start + RADIX_CHUNK]
            patterns = np.bitwise_and(piece, magnitude, out=buffer[: piece.size])
            if shift + width < bits:  # only those that share the digits found so far
                low = prefix << (shift + width)
                patterns = patterns[(patterns >= low) & (patterns < low + (1 << (shift + width)))]
                np.bitwise_and(patterns, (1 << (shift + width)) - 1, out=patterns)
            digits = np.right_shift(patterns, shift, out=patterns)
            np.add.at(from_top, np.bitwise_xor(digits, top, out=digits), 1)  # at top - digit
        np.cumsum(from_top, out=from_top)  # from_top[j]: elements with a digit >= top - j
        j = int(np.searchsorted(from_top, need))  # the first j where the sum reaches need
        need -= int(from_top[j - 1]) if j else 0
        prefix = (prefix << width) | (top - j)
    return prefix, need


def at_or_above(words: np.ndarray, magnitude: int, threshold: int, ties: int) -> np.ndarray:
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
