"""Where a flat bucket holds a parameter's elements: in the parameter's memory order.

DDP's reducer lays each parameter's gradient into its flat bucket with the parameter's own
strides when the parameter is dense and non-overlapping (PyTorch's "gradient layout
contract"): a ``channels_last`` convolution weight of shape ``(N, C, H, W)`` and strides
``(C H W, 1, W C, C)`` sits in the bucket channels fastest, ``(n, h, w, c)`` order, not in the
row-major ``(n, c, h, w)`` order of ``tensor.reshape(-1)``. Any other parameter is laid
row-major. Everything the hook moves between a parameter-shaped tensor (the parameter, its
``.grad``, an optimizer's momentum buffer or ``exp_avg``, a variance) and a flat bucket goes
through the two functions here:

* :func:`flat_like`: a tensor shaped like ``param``, its elements in ``param``'s bucket order
  (a view when the tensor has ``param``'s strides: ``tensor.permute(order).reshape(-1)``);
* :func:`shaped_like`: the inverse, a flat tensor's elements as a tensor of ``param``'s shape
  and strides (a view of a contiguous ``flat``), which writes through to the bucket.

``order`` is :func:`memory_order`: the dimensions from the outermost (largest stride) to the
innermost; for a row-major parameter both functions are plain reshapes.
"""

from __future__ import annotations

import torch


def memory_order(param: torch.Tensor) -> list[int] | None:
    """``param``'s dimensions from the largest stride to the smallest, when that is not the
    row-major order and ``param`` is dense and non-overlapping (each stride, over a dimension of
    more than one element, the product of the sizes inside it); None otherwise (row-major)."""
    if param.is_contiguous():
        return None
    strides = param.stride()
    order = sorted(range(param.dim()), key=lambda dim: -strides[dim])  # stable: ties keep their order
    expected = 1
    for dim in reversed(order):
        if param.size(dim) != 1 and strides[dim] != expected:
            return None  # overlapping or with gaps: DDP lays it row-major
        expected *= param.size(dim)
    return order


def flat_like(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``param``'s shape) flattened in ``param``'s bucket order."""
    order = memory_order(param)
    return tensor.reshape(-1) if order is None else tensor.permute(order).reshape(-1)


def shaped_like(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``flat`` (``param.numel()`` elements in ``param``'s bucket order) as a tensor of
    ``param``'s shape: element ``i`` of ``flat`` at the index ``param``'s memory holds at ``i``."""
    order = memory_order(param)
    if order is None:
        return flat.reshape(param.shape)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return flat.reshape([param.size(dim) for dim in order]).permute(inverse)
