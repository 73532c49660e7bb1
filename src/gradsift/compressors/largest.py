"""The ``k`` largest magnitudes of a gradient: one ``topk`` on a device, a radix select on CPU.

On CPU the magnitudes are ordered by their bit patterns (the sign cleared:
:data:`~gradsift.compressors.kernels.MAGNITUDE_BITS`), and :mod:`gradsift.compressors.radix`
finds the ``k`` largest a digit at a time over chunks of the tensor, ties to the lower
position (the order :func:`~gradsift.compressors.kernels.ranking_keys` gives): its
temporaries are a chunk's, the counts' and the ``k`` positions', never a value and a
position per element read, which PyTorch's CPU ``topk`` holds (docs/decisions.md).
"""

from __future__ import annotations

import torch

from gradsift.compressors.kernels import MAGNITUDE_BITS, numpy_view, uses_numpy
from gradsift.compressors.radix import largest_positions

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
    indices = torch.from_numpy(largest_positions(numpy_view(flat.view(integer)), magnitude, k))
    return flat.index_select(0, indices).abs(), indices
