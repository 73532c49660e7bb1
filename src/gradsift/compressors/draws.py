"""Counter-based random draws: the same numbers on every device, from ``(key, counter)`` alone.

Where every worker must draw the same positions (random-k's ``k``, CocktailSGD's subsets)
a device generator is not enough: large CUDA draws split their Philox stream by the
launch grid, which follows the GPU's multiprocessor count, so two GPU models -- or the
CPU and a GPU -- draw different numbers from one seed. Here a draw is a hash of a 64-bit
stream key and the draw's counter, computed with integer tensor operations that mean
the same on every device (no float, no overflow, logical shifts only):

* :func:`words`: ``h(key, i)`` for ``i = 0 .. count-1``, 32-bit words. The mixer is Chris
  Wellons's ``lowbias32`` (``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
  x ^= x >> 16``), applied as ``mix(mix(i ^ k_0) ^ k_1)`` with the key's two 32-bit
  halves. Every value lives in an int64 lane below ``2^32``; a product modulo ``2^32`` is
  built from 16-bit halves of the constant (:func:`_times_`), so no intermediate reaches
  ``2^63`` and right shifts never see a sign bit.
* :func:`below`: uniform integers in ``[0, n)`` from two words per draw (:func:`wide`),
  ``(w_hi 2^32 + w_lo) mod n`` with ``w_hi`` cut to 31 bits (bias below ``n / 2^63``);
  :func:`permutation`: positions sorted by such a value each.

No host read, one small kernel per operation over the ``count`` draws.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import torch

_WORD = 0xFFFF_FFFF
_MIX = (0x7FEB352D, 0x846CA68B)
#: XOR-ed into both key halves for the second word of a draw (the golden-ratio constant).
_SECOND = 0x9E3779B9


def stream_seed(seed: int, key: Hashable, step: int) -> int:
    """A 63-bit stream key from ``(seed, key, step)``, equal in every process.

    Uses BLAKE2b of ``repr((seed, key, step))``: Python's ``hash()`` is salted per
    process. Keys must therefore have a process-independent ``repr`` (ints,
    strings, tuples of them -- bucket indices and parameter names do).
    """
    digest = hashlib.blake2b(repr((seed, key, step)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def split(key: int) -> tuple[int, int]:
    """A 64-bit key's two 32-bit halves (low, high)."""
    return key & _WORD, (key >> 32) & _WORD


def _times_(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x <- x * constant mod 2^32`` in place, for ``0 <= x < 2^32`` in int64 lanes, without
    overflow: ``x low + ((x high) mod 2^16) 2^16`` with ``constant = high 2^16 + low``."""
    low, high = constant & 0xFFFF, constant >> 16
    upper = x * high
    upper &= 0xFFFF
    upper <<= 16
    return x.mul_(low).add_(upper).bitwise_and_(_WORD)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` of every lane of ``x``, in place (a tensor of the caller's own)."""
    x ^= x >> 16
    _times_(x, _MIX[0])
    x ^= x >> 15
    _times_(x, _MIX[1])
    x ^= x >> 16
    return x


def words(key: int, count: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """``count`` 32-bit hash words ``h(key, start + i)`` as int64 in ``[0, 2^32)``."""
    low, high = split(key)
    lanes = torch.arange(start, start + count, dtype=torch.int64, device=device)
    lanes &= _WORD
    lanes ^= low
    _mix_(lanes)
    lanes ^= high
    return _mix_(lanes)


def wide(key: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` 63-bit hash values (int64 in ``[0, 2^63)``): two words per draw."""
    low, high = split(key)
    first = words(key, count, device)
    first &= 0x7FFF_FFFF
    first <<= 32
    first |= words(((high ^ _SECOND) << 32) | (low ^ _SECOND), count, device)
    return first


def below(n: int, key: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` uniform int64 draws from ``[0, n)`` (``n >= 1``), a function of ``(key, i)`` only."""
    return wide(key, count, device).remainder_(n)


def permutation(n: int, key: int, device: torch.device) -> torch.Tensor:
    """A uniformly random permutation of ``[0, n)``: positions sorted by a 63-bit hash each
    (a stable sort, so even a tie, a 2^-63 event, orders the same everywhere)."""
    return torch.sort(wide(key, n, device), stable=True).indices
