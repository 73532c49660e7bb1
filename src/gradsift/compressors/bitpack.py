"""Pack fixed-width unsigned integer codes into bytes, and back.

A code ``c_i`` of width ``b`` bits (``0 <= c_i < 2**b``) occupies bits
``i*b .. i*b + b - 1`` of one little-endian bit stream: stream bit ``p`` is bit
``p mod 8`` of byte ``p div 8``, and bit ``j`` of code ``i`` is stream bit ``i*b + j``.
``n`` codes therefore take exactly ``packed_nbytes(n, b) = ceil(n*b / 8)`` bytes; the
unused high bits of the last byte are zero.

Both directions are vectorised; no loop runs over elements. One-bit codes in CPU memory are
NumPy's ``packbits`` / ``unpackbits`` in little-endian bit order, which is this layout. When
``b`` divides 8 (1, 2, 4, 8) codes never straddle a byte and ``8/b`` codes are shifted into
place and summed per byte. Other widths (3, 5, 6, 7) work on whole groups of 8 codes, which fill exactly ``b``
bytes: the group's codes are laid out as 8 planes (plane ``i`` holds code ``i`` of every
group, contiguous), and byte ``j`` of every group is the OR of the planes whose bits
overlap stream bits ``8j .. 8j + 7``, each shifted by ``b i - 8j`` (left when positive; a
uint8 shift drops the bits that belong to the next byte); unpacking cuts code ``i`` from
byte ``floor(b i / 8)`` and, when it straddles, the next byte. Every step is uint8
arithmetic on ``n / 8`` elements, a few passes over the codes' own bytes. Codes come back
as uint8, and a decoder widens them to its own arithmetic's dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from gradsift.compressors.kernels import numpy_view, uses_numpy
from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.validation import check_int

#: Widest code supported: a code fits one byte.
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
    if bits == 1 and uses_numpy(codes):
        return torch.from_numpy(np.packbits(numpy_view(codes.to(torch.uint8)), bitorder="little"))
    if 8 % bits == 0:
        per_byte = 8 // bits
        grouped = _padded(codes.to(torch.uint8), nbytes * per_byte).view(nbytes, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (grouped << shifts).sum(dim=1, dtype=torch.uint8)
    planes = _planes(codes.to(torch.uint8), 8)
    packed = torch.zeros(bits, planes.shape[1], dtype=torch.uint8, device=codes.device)
    for code in range(8):
        start = bits * code
        for byte in range(start // 8, (start + bits - 1) // 8 + 1):
            offset = start - 8 * byte
            packed[byte].bitwise_or_(planes[code] << offset if offset >= 0 else planes[code] >> -offset)
    return packed.t().reshape(-1)[:nbytes]


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes of ``packed``, as uint8."""
    bits = check_int(bits, "bits", low=1, high=MAX_BITS)
    numel = check_int(numel, "numel", low=0)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise InvalidTensorError(f"packed must be a 1-D uint8 tensor, got {_describe(packed)}")
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise InvalidOptionError(
            f"packed holds {packed.numel()} bytes, but {numel} codes of {bits} bits need {expected}"
        )
    if bits == 1 and uses_numpy(packed):
        return torch.from_numpy(np.unpackbits(numpy_view(packed), count=numel, bitorder="little"))
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.view(-1)[:numel]
    planes = _planes(packed, bits)
    codes = torch.empty(8, planes.shape[1], dtype=torch.uint8, device=packed.device)
    for code in range(8):
        byte, shift = divmod(bits * code, 8)
        piece = codes[code]
        torch.bitwise_right_shift(planes[byte], shift, out=piece)
        if shift + bits > 8:  # the code straddles into the next byte
            piece.bitwise_or_(planes[byte + 1] << (8 - shift))
        piece.bitwise_and_((1 << bits) - 1)
    return codes.t().reshape(-1)[:numel]


def _planes(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` zero-padded to whole groups of ``width`` elements, as ``width`` contiguous planes:
    ``planes[i, g]`` is element ``i`` of group ``g``."""
    groups = -(-flat.numel() // width)
    return _padded(flat, groups * width).view(groups, width).t().contiguous()


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    """``flat`` followed by zeros up to ``length`` elements (no copy when already that long)."""
    missing = length - flat.numel()
    return flat if missing == 0 else torch.cat([flat, flat.new_zeros(missing)])


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dim()}-D {value.dtype}"
    return type(value).__name__
