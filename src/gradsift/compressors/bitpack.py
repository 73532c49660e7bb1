"""Pack fixed-width unsigned integer codes into bytes, and back.

A code ``c_i`` of width ``b`` bits (``0 <= c_i < 2**b``) occupies bits
``i*b .. i*b + b - 1`` of one little-endian bit stream: stream bit ``p`` is bit
``p mod 8`` of byte ``p div 8``, and bit ``j`` of code ``i`` is stream bit ``i*b + j``.
``n`` codes therefore take exactly ``packed_nbytes(n, b) = ceil(n*b / 8)`` bytes; the
unused high bits of the last byte are zero.

Both directions are vectorised, in whole groups of 8 codes (``b`` bytes, at most 64
bits: one int64 word). When ``b`` divides 8 (1, 2, 4, 8) codes never straddle a byte and
``8/b`` uint8 codes are shifted into place and summed per byte. Other widths (3, 5, 6,
7) shift the 8 codes of a group to bits ``0, b, 2b, ...`` of a word, sum them (the bits
are disjoint, so the sum is an OR) and cut the word into its ``b`` bytes; unpacking
reverses the two steps. No loop runs over elements. Codes come back in the integer dtype
they were cut in -- uint8 for the widths that divide 8, int64 (the words') for the others --
and a decoder widens them to its own arithmetic's dtype: a 1-, 2- or 4-bit code holds one
byte per element while it is decoded, not eight.
"""

from __future__ import annotations

import torch

from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.validation import check_int

#: Widest code supported: 8 codes of at most 8 bits fill one int64 word.
MAX_BITS = 8

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy: ``ceil(numel * bits / 8)``."""
    return (numel * bits + 7) // 8


def bits_for(max_code: int) -> int:
    """Width in bits needed to store every code in ``[0, max_code]`` (at least 1)."""
    return max(1, int(max_code).bit_length())


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the 1-D integer ``codes`` (each in ``[0, 2**bits)``) into a uint8 tensor.

    The caller guarantees the range (codes come from quantizers that construct them):
    it is not checked on the hot path, and an out-of-range code would spill into its
    neighbours.
    """
    bits = check_int(bits, "bits", low=1, high=MAX_BITS)
    if not isinstance(codes, torch.Tensor) or codes.dtype not in _INTEGER_DTYPES or codes.dim() != 1:
        raise InvalidTensorError(f"codes must be a 1-D integer tensor, got {_describe(codes)}")
    numel = codes.numel()
    nbytes = packed_nbytes(numel, bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        grouped = _padded(codes.to(torch.uint8), nbytes * per_byte).view(nbytes, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (grouped << shifts).sum(dim=1, dtype=torch.uint8)
    groups = -(-numel // 8)
    grouped = _padded(codes.to(torch.int64), groups * 8).view(groups, 8)
    words = (grouped << _steps(bits, 8, codes.device)).sum(dim=1)  # disjoint bits: the sum is an OR
    octets = (words.unsqueeze(1) >> _steps(8, bits, codes.device)) & 0xFF
    return octets.view(-1)[:nbytes].to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes of ``packed``, as uint8 when ``bits``
    divides 8, else int64."""
    bits = check_int(bits, "bits", low=1, high=MAX_BITS)
    numel = check_int(numel, "numel", low=0)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise InvalidTensorError(f"packed must be a 1-D uint8 tensor, got {_describe(packed)}")
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise InvalidOptionError(
            f"packed holds {packed.numel()} bytes, but {numel} codes of {bits} bits need {expected}"
        )
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.view(-1)[:numel]
    groups = -(-numel // 8)
    octets = _padded(packed, groups * bits).view(groups, bits).to(torch.int64)
    words = (octets << _steps(8, bits, packed.device)).sum(dim=1)
    codes = (words.unsqueeze(1) >> _steps(bits, 8, packed.device)) & ((1 << bits) - 1)
    return codes.view(-1)[:numel]


def _steps(step: int, count: int, device: torch.device) -> torch.Tensor:
    """``[0, step, 2*step, ..., (count-1)*step]`` as int64: shifts of codes in a word or bytes in it."""
    return torch.arange(0, step * count, step, dtype=torch.int64, device=device)


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    """``flat`` followed by zeros up to ``length`` elements (no copy when already that long)."""
    missing = length - flat.numel()
    return flat if missing == 0 else torch.cat([flat, flat.new_zeros(missing)])


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dim()}-D {value.dtype}"
    return type(value).__name__
