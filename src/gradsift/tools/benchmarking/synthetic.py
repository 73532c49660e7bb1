"""The benchmark's input: a heavy-tailed synthetic gradient, fixed seed (:func:`synthetic_gradient`)."""

from __future__ import annotations

import torch

#: Elements per block of :func:`synthetic_gradient` sharing one scale (a small layer's worth).
SCALE_BLOCK = 4096
INPUT_DESCRIPTION = (
    f"Laplace(0, 1) values times a log-normal scale exp(N(0, 1)) per block of {SCALE_BLOCK} "
    "elements (a scale mixture: layers of different magnitudes, heavier tails than Laplace), "
    "drawn in float32 and cast to the run's dtype"
)


def synthetic_gradient(
    numel: int, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A heavy-tailed gradient: ``x_i = s_{i // B} * L_i`` (see :data:`INPUT_DESCRIPTION`), drawn in float32.

    ``L_i ~ Laplace(0, 1)`` (a random sign times an ``Exp(1)`` magnitude) and one
    ``s_b = exp(Z_b)``, ``Z_b ~ N(0, 1)``, per block of ``B = 4096`` elements.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(numel).exponential_(generator=generator)
    x *= torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8).mul_(2).sub_(1)
    scales = torch.randn(-(-numel // SCALE_BLOCK), generator=generator).exp_()
    x *= scales.repeat_interleave(SCALE_BLOCK)[:numel]
    return x.to(device, dtype)
