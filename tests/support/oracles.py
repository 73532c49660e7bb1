"""Methods written out from their definitions, element by element: the tests' oracles."""

from __future__ import annotations

from collections.abc import Callable

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
    ``u = m / ((1 - beta1)(1 - beta1^t))`` and the preconditioner ``D = sqrt(v / (1 - beta2^t)) + eps``
    (where ``v = 0``, the largest ``sqrt`` of the parameter's tensor; nowhere below a hundredth of
    the tensor's root-mean-square ``sqrt``)."""
    beta1, beta2 = betas
    velocity, preconditioner = {}, {}
    for p in params:
        state = optimizer.state[p]
        t = float(state["step"])
        velocity[p] = state["exp_avg"] / ((1 - beta1) * (1 - beta1**t))
        root = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
        floor = 0.01 * float(root.pow(2).mean()) ** 0.5
        nonzero = torch.where(root > 0, root, root.max())  # v = 0: the tensor's largest
        preconditioner[p] = nonzero.clamp(min=floor) + eps
    return velocity, preconditioner


def four_bit_blocks(x: torch.Tensor) -> torch.Tensor:
    """``blockquant``'s default code by definition: 4 bits, blocks of 64."""
    return quantized_by_definition(x, bits=4, block=64)


def error_feedback_mean(
    gradients: list[torch.Tensor], residuals: list[torch.Tensor], code: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Plain error feedback over the workers, written out: worker ``k`` sends ``code(c_k)`` of
    ``c_k = g_k + r_k`` and keeps ``r_k <- c_k - code(c_k)`` (``residuals`` updated in place);
    returns the workers' mean of what they sent."""
    sent = []
    for gradient, residual in zip(gradients, residuals, strict=True):
        compensated = gradient + residual
        sent.append(code(compensated))
        residual.copy_(compensated - sent[-1])
    return sum(sent) / len(sent)


def frozen_variance_step(
    params: list[torch.Tensor],
    means: list[torch.Tensor],
    velocity: dict[torch.Tensor, torch.Tensor],
    preconditioner: dict[torch.Tensor, torch.Tensor],
    left: list[torch.Tensor],
    beta1: float,
    lr: float,
    weight_decay: float,
) -> None:
    """One compressed step of the frozen-variance AdamW with every coordinate sent, written out:
    ``u <- beta1 u + mean g``, ``m = (1 - beta1)(u + left)`` (what a warm-up's code left), the
    norm of ``m`` clipped to 1, ``x <- x (1 - lr wd) - lr m / D``."""
    for p, mean, rest in zip(params, means, left, strict=True):
        velocity[p] = beta1 * velocity[p] + mean.reshape(p.shape)
        p.grad = (1 - beta1) * (velocity[p] + rest.reshape(p.shape))
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for p in params:
        p.mul_(1 - lr * weight_decay)
        p.sub_(lr * p.grad / preconditioner[p])
