"""A sum over ``W`` workers made their mean as ``sum * (1 / W)``: the hook's stock step, the
allreduce exchange and the sparse decode (``scatter_mean``, float32 and wider) use it; and a
gradient divided by a loss scale the way ``GradScaler`` unscales it (:func:`unscaled`).

Stock DDP's reducer multiplies each gradient by ``1 / W`` as it copies it into the bucket
(``mul_out`` with the reciprocal), so a mean computed the same way equals stock DDP's bit
for bit at any ``W`` (``sum / W`` differs in the last bit when ``W`` is not a power of
two). A multiplication is also no dearer than a division on any CPU; on the hook's step
the difference is below the run-to-run spread (docs/decisions.md, "A mean is a
multiplication by 1/W").
"""

from __future__ import annotations

import torch


def divide_(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``tensor <- tensor * (1 / count)`` in place; returns ``tensor``."""
    return tensor.mul_(1.0 / count)


def divided(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``tensor * (1 / count)`` in a new tensor."""
    return torch.mul(tensor, 1.0 / count)


def unscaled(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor`` divided by the loss ``scale`` as ``GradScaler`` unscales: times the scale's
    inverse computed in float64 and rounded to float32, in a new tensor."""
    return tensor * scale.double().reciprocal().float()
