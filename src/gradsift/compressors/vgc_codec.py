"""VGC's wire encoding: one 32-bit word per sent element.

A word packs a 28-bit index and a 4-bit code (1 sign bit, 3-bit level ``l``)::

    word = (local_index << 4) | (sign << 3) | l            (as unsigned 32 bits)

The level is relative to a per-message scale ``M = max |r_sent|``:
``l = clamp(round(log2(M / |r|)), 0, 7)`` and the decoded value is
``Q(r) = (-1)^sign * M * 2^-l`` (so ``|Q(r)| / |r|`` lies in ``[2^-0.5, 2^0.5]`` for
``|r| >= M * 2^-7.5``; smaller magnitudes are rounded up to ``M / 128``).

Tensors over ``2^28`` elements are split into ``K = ceil(numel / 2^28)`` chunks; chunk
``j`` covers indices ``[j * 2^28, (j + 1) * 2^28)`` and its index base ``j * 2^28`` is
implied by its position. A message is::

    codes  (int32): [count_0, ..., count_{K-1}, word, word, ...]   words sorted by index
    scales (float32): [M]

so a message with ``k`` elements takes ``4 * (K + k) + 4`` data bytes (``K = 1`` below
``2^28`` elements), plus the wire's 4-byte length (see ``Payload.nbytes``). Under the
DDP hook a message has room for a fixed number of words (``capacity``), of which the
first ``length`` are in use; the rest are 0 and decode to nothing.

:func:`decode_words` decodes without any host read and reports what a peer got wrong
as a device bitmask (:data:`PROBLEMS`), decoding a malformed message into harmless
entries (index 0, value 0) instead; :func:`decode` is the strict host-side check of an
exact message, raising :class:`~gradsift.core.errors.WireFormatError`.
"""

from __future__ import annotations

import torch

from gradsift.core.errors import WireFormatError
from gradsift.core.payload import Count

INDEX_BITS = 28
CHUNK_SIZE = 1 << INDEX_BITS
LEVEL_BITS = 3
MAX_LEVEL = (1 << LEVEL_BITS) - 1
_CODE_BITS = 1 + LEVEL_BITS
_CODE_MASK = (1 << _CODE_BITS) - 1
_SIGN_BIT = 1 << LEVEL_BITS


#: Bits of :func:`decode_words`' problem mask, and what each means.
PROBLEMS = {
    1: "chunk counts do not add up to the words sent",
    2: "scale must be finite and > 0 when elements are sent",
    4: "indices must be < numel",
    8: "indices must be strictly increasing",
}


def representable(magnitudes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Mask of magnitudes that do not round up: ``|r| >= M * 2^-(7 + 1/2)`` (level 7 or less)."""
    return magnitudes >= scale * 2.0 ** -(MAX_LEVEL + 0.5)


def chunk_count(numel: int) -> int:
    """Number of 2^28-element chunks a tensor of ``numel`` elements is split into."""
    return (numel + CHUNK_SIZE - 1) >> INDEX_BITS


def encode(
    indices: torch.Tensor, values: torch.Tensor, numel: int, length: Count | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode sent elements ``values`` at sorted, unique ``indices`` of a ``numel`` tensor.

    Returns ``(codes, scales, quantized)``: the int32 message, the float32 ``[M]`` and
    ``Q(values)`` in ``values``' dtype, exactly what :func:`decode` will return. With
    ``length``, only the first ``length`` entries are in use: the others encode as the
    word 0, quantize to 0 and are not counted. Every ``values`` element in use must be
    finite and non-zero (the caller's selection guarantees it; a non-finite one makes
    ``M`` non-finite, which the caller checks). No host read.
    """
    used = None if length is None else torch.arange(values.numel(), device=values.device) < length
    magnitudes = values.abs().float()
    if used is not None:
        magnitudes = torch.where(used, magnitudes, 0.0)
    scale = magnitudes.max() if magnitudes.numel() else magnitudes.new_zeros(())
    levels = torch.log2(scale / magnitudes).round_().clamp_(0, MAX_LEVEL).to(torch.int64)
    codes = levels | (values < 0).to(torch.int64) << LEVEL_BITS
    chunk_ids = indices >> INDEX_BITS
    weights = torch.ones_like(chunk_ids) if used is None else used.to(torch.int64)
    counts = torch.zeros(chunk_count(numel), dtype=torch.int64, device=indices.device)
    counts.index_add_(0, chunk_ids, weights)
    local = indices & (CHUNK_SIZE - 1)
    words = (local << _CODE_BITS) | codes
    words = words - ((words >> 31) << 32)  # unsigned 32 bits -> two's-complement int32
    quantized = _dequantize(codes, scale).to(values.dtype)
    if used is not None:
        words = torch.where(used, words, 0)
        quantized = torch.where(used, quantized, 0)
    message = torch.cat([counts, words]).to(torch.int32)
    return message, scale.reshape(1), quantized


def decode_words(
    codes: torch.Tensor, scales: torch.Tensor, numel: int, length: Count | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode a message into ``(indices int64, values float32, problems)`` without a host read.

    ``codes`` holds the chunk counts and then the words, of which the first ``length``
    (all without it) are in use. ``problems`` is a 0-d int bitmask of :data:`PROBLEMS`;
    entries that are not in use, or that lie outside ``[0, numel)``, decode to index 0
    and value 0, so a malformed message adds nothing anywhere it could harm.
    """
    chunks = chunk_count(numel)
    counts = codes[:chunks].to(torch.int64)
    words = codes[chunks:].to(torch.int64) & 0xFFFFFFFF
    device = codes.device
    positions = torch.arange(words.numel(), device=device)
    used = positions < (words.numel() if length is None else length)
    in_use = used.sum()
    problems = torch.where(((counts < 0).any()) | (counts.sum() != in_use), 1, 0)
    scale = scales[0]
    bad_scale = ~torch.isfinite(scale) | (scale < 0) | ((in_use > 0) & (scale == 0))
    problems = problems | torch.where(bad_scale, 2, 0)
    if chunks == 1:
        bases = torch.zeros_like(words)
    else:
        ends = torch.cumsum(counts.clamp_min(0), 0)
        bases = torch.searchsorted(ends, positions, right=True).clamp_max(chunks - 1) << INDEX_BITS
    indices = bases + (words >> _CODE_BITS)
    outside = used & (indices >= numel)
    problems = problems | torch.where(outside.any(), 4, 0)
    if words.numel() > 1:
        repeated = used[1:] & (indices[1:] <= indices[:-1])
        problems = problems | torch.where(repeated.any(), 8, 0)
    keep = used & ~outside
    values = torch.where(keep, _dequantize(words & _CODE_MASK, scale), 0.0)
    return torch.where(keep, indices, 0), values, problems


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode an exact message into ``(indices int64, values float32)``; validate it strictly.

    Raises :class:`WireFormatError` for a wrong dtype or shape, chunk counts that do
    not add up to the number of words, a scale that is negative, non-finite or zero
    while elements were sent, an index ``>= numel``, or indices not strictly
    increasing (a repeated index would be added twice). One host read.
    """
    chunks = chunk_count(numel)
    if codes.dtype != torch.int32 or codes.dim() != 1:
        raise WireFormatError(
            f"vgc codes must be a 1-D int32 tensor, got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    if scales.dtype != torch.float32 or scales.shape != (1,):
        raise WireFormatError(
            f"vgc scales must be a float32 tensor of shape (1,), got {scales.dtype} {tuple(scales.shape)}"
        )
    if codes.numel() < chunks:
        raise WireFormatError(f"vgc message has {codes.numel()} words, fewer than its {chunks} chunk counts")
    indices, values, problems = decode_words(codes, scales, numel)
    found = int(problems)
    if found:
        raise WireFormatError(
            "vgc message: " + "; ".join(text for bit, text in PROBLEMS.items() if found & bit)
        )
    return indices, values


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Q = (-1)^sign * M * 2^-level`` for 4-bit codes (int64), in float32."""
    magnitudes = scale.float() * torch.exp2(-(codes & MAX_LEVEL).float())
    return torch.where((codes & _SIGN_BIT).bool(), -magnitudes, magnitudes)
