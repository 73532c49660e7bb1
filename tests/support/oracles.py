"""Methods written out from their definitions, element by element: the tests' oracles."""

from __future__ import annotations

import torch


def quantized_by_definition(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``(round(x_i (L / s_B))) (s_B / L)`` block by block, ``s_B`` the block's largest ``|x_i|``,
    ``L = 2^(bits-1) - 1``, ties to even (Python's ``round``), element by element."""
    levels = 2 ** (bits - 1) - 1
    out = []
    values = x.tolist()
    for start in range(0, len(values), block):
        chunk = x[start : start + block]
        scale = chunk.abs().max()
        step_up = torch.tensor(levels, dtype=x.dtype) / scale if scale > 0 else torch.tensor(0.0)
        step_down = scale / levels
        for value in chunk:
            q = float(round(float(value * step_up)))
            out.append(float(torch.tensor(q, dtype=x.dtype) * step_down))
    return torch.tensor(out, dtype=x.dtype)


def frozen_variance_start(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    betas: tuple[float, float],
    eps: float = 1e-8,
) -> tuple[dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    """1-bit Adam's freeze, from Adam's state at its step ``t``: per parameter the velocity
    ``u = m / ((1 - beta1)(1 - beta1^t))`` and the preconditioner ``D = sqrt(v / (1 - beta2^t)) + eps``."""
    beta1, beta2 = betas
    velocity, preconditioner = {}, {}
    for p in params:
        state = optimizer.state[p]
        t = float(state["step"])
        velocity[p] = state["exp_avg"] / ((1 - beta1) * (1 - beta1**t))
        preconditioner[p] = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt() + eps
    return velocity, preconditioner
