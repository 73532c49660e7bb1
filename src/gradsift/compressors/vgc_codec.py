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
``2^28`` elements), plus the wire's 4-byte length per field (see ``Payload.nbytes``).
:func:`decode` validates everything a peer could get wrong and raises
:class:`~gradsift.errors.WireFormatError`.
"""

from __future__ import annotations

import torch

from gradsift.errors import WireFormatError

INDEX_BITS = 28
CHUNK_SIZE = 1 << INDEX_BITS
LEVEL_BITS = 3
MAX_LEVEL = (1 << LEVEL_BITS) - 1
_CODE_BITS = 1 + LEVEL_BITS
_CODE_MASK = (1 << _CODE_BITS) - 1
_SIGN_BIT = 1 << LEVEL_BITS


def representable(magnitudes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Mask of magnitudes that do not round up: ``|r| >= M * 2^-(7 + 1/2)`` (level 7 or less)."""
    return magnitudes >= scale * 2.0 ** -(MAX_LEVEL + 0.5)


def chunk_count(numel: int) -> int:
    """Number of 2^28-element chunks a tensor of ``numel`` elements is split into."""
    return (numel + CHUNK_SIZE - 1) >> INDEX_BITS


def encode(
    indices: torch.Tensor, values: torch.Tensor, numel: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode sent elements ``values`` at sorted, unique ``indices`` of a ``numel`` tensor.

    Returns ``(codes, scales, quantized)``: the int32 message, the float32 ``[M]`` and
    ``Q(values)`` in ``values``' dtype, exactly what :func:`decode` will return.
    Every ``values`` element must be finite and non-zero (the caller's selection
    guarantees it; a non-finite one makes ``M`` non-finite, which the caller checks).
    """
    magnitudes = values.abs().float()
    scale = magnitudes.max() if magnitudes.numel() else magnitudes.new_zeros(())
    levels = torch.log2(scale / magnitudes).round_().clamp_(0, MAX_LEVEL).to(torch.int64)
    codes = levels | (values < 0).to(torch.int64) << LEVEL_BITS
    chunk_ids = indices >> INDEX_BITS
    counts = torch.bincount(chunk_ids, minlength=chunk_count(numel))
    local = indices & (CHUNK_SIZE - 1)
    words = (local << _CODE_BITS) | codes
    words = words - ((words >> 31) << 32)  # unsigned 32 bits -> two's-complement int32
    message = torch.cat([counts, words]).to(torch.int32)
    quantized = _dequantize(codes, scale).to(values.dtype)
    return message, scale.reshape(1), quantized


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a message into ``(indices int64, values float32)``; validate it strictly.

    Raises :class:`WireFormatError` for a wrong dtype or shape, chunk counts that do
    not add up to the number of words, a scale that is negative, non-finite or zero
    while elements were sent, an index ``>= numel``, or indices not strictly
    increasing (a repeated index would be added twice).
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
    counts = codes[:chunks].to(torch.int64)
    words = codes[chunks:].to(torch.int64) & 0xFFFFFFFF
    if bool((counts < 0).any()) or int(counts.sum()) != words.numel():
        raise WireFormatError(
            f"vgc chunk counts {counts.tolist()} do not add up to the {words.numel()} words sent"
        )
    scale = scales[0]
    if not bool(torch.isfinite(scale)) or float(scale) < 0 or (words.numel() and float(scale) == 0):
        raise WireFormatError(f"vgc scale must be finite and > 0 when elements are sent, got {float(scale)}")
    bases = torch.repeat_interleave(
        torch.arange(chunks, device=codes.device, dtype=torch.int64) << INDEX_BITS, counts
    )
    indices = bases + (words >> _CODE_BITS)
    if words.numel() and (int(indices[-1]) >= numel or bool((indices[1:] <= indices[:-1]).any())):
        raise WireFormatError(f"vgc indices must be strictly increasing and < numel={numel}")
    return indices, _dequantize(words & _CODE_MASK, scale)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Q = (-1)^sign * M * 2^-level`` for 4-bit codes (int64), in float32."""
    magnitudes = scale.float() * torch.exp2(-(codes & MAX_LEVEL).float())
    return torch.where((codes & _SIGN_BIT).bool(), -magnitudes, magnitudes)
