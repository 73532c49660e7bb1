"""Compressed training with Adam and AdamW: error feedback on the first moment, the second frozen.

Why plain error feedback breaks Adam: a sparsifier sends a coordinate about once every
``1/density`` steps, carrying the sum of the skipped gradients; Adam divides that sum by
``sqrt(v)`` like any single gradient, so the coordinate takes one ordinary step instead
of ``1/density`` of them, and training slows by about the density.

What ``register_comm_hook(ddp, compressor, optimizer=adam)`` does instead (after 1-bit
Adam, Tang et al. 2021, with DGC's momentum correction for the first moment):

1. **Warm-up** -- the first ``warmup_steps`` steps are stock DDP + the optimizer as built:
   dense allreduce of the gradients, Adam's own ``exp_avg`` ``m`` and ``exp_avg_sq`` ``v``.
2. **Freeze** ``v`` -- from then on the optimizer never steps the model's parameters
   again, so their ``exp_avg_sq`` and ``step`` stay as the warm-up left them; the
   preconditioner ``D = sqrt(v / (1 - beta2^t)) + eps`` is constant, and the update
   ``m / D`` is linear in ``m``.
3. **Compressed steps** -- each worker keeps a velocity ``u <- beta1 u + g`` (started from
   the warm-up's ``m / ((1 - beta1)(1 - beta1^t))``, Adam's bias-corrected first moment
   in velocity units), sends ``u + r`` through the compressor with error feedback
   (residual ``r``; momentum factor masking as in DGC), and the exchange's mean ``s``
   stands for ``sum_k u_k / W``. The hook hands DDP ``(1 - beta1) s`` -- Adam's first moment,
   at a gradient's scale, so ``clip_grad_norm_`` and ``GradScaler`` see what they expect --
   and the optimizer's step becomes ``theta <- theta (1 - lr wd) - lr m / D`` (AdamW's
   decoupled decay; Adam's L2 decay ``wd theta`` is added to ``g`` before the velocity).
   Because ``m / D`` is linear in what was sent, error feedback's delayed coordinates are
   delayed, not shrunk: DGC's argument for SGD momentum carries over.

The optimizer step is taken over by a step pre-hook (:class:`FrozenVarianceStep`) that
applies the update above to the model's parameters and clears their ``.grad``, so the
optimizer skips them; learning-rate schedulers, ``GradScaler.step`` (which calls the
optimizer's step only when the gradients are finite) and parameters outside the model
work as usual. Nothing is kept outside the optimizer's own state and the hook's state
store, so ``optimizer.state_dict()`` plus the hook's ``state_dict()`` resume bit for bit.

Supported: ``torch.optim.Adam`` and ``torch.optim.AdamW`` without ``amsgrad`` and
``maximize``. Others (LAMB, Adafactor, Lion, ...) are refused with a clear error: their
updates are not linear in a first moment once a statistic is frozen, or they keep no
first moment at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsift.errors import InvalidOptionError

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)


def is_adam(optimizer: object) -> bool:
    """Whether ``optimizer`` is one of the Adam family the hook can take over."""
    return isinstance(optimizer, ADAM_FAMILY)


def check_adam(optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> float:
    """The one ``beta1`` of the groups holding the model's parameters; refuses what the
    frozen-variance step does not implement."""
    betas = set()
    for index, group in enumerate(optimizer.param_groups):
        if not any(id(p) in numbers for p in group["params"]):
            continue
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise InvalidOptionError(
                    f"optimizer param group {index}: {flag}=True is not supported by gradsift's compressed Adam"
                )
        betas.add(float(group["betas"][0]))
    if len(betas) > 1:
        raise InvalidOptionError(f"the model's parameter groups use different beta1 {sorted(betas)}: use one")
    if not betas:
        raise InvalidOptionError("the optimizer holds none of the model's parameters")
    return betas.pop()


def l2_decay(optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> dict[int, float]:
    """Adam's (not AdamW's) L2 weight decay per parameter number: added to the gradient
    before the velocity in compressed steps, as Adam adds it before its moments."""
    if isinstance(optimizer, torch.optim.AdamW):
        return {}
    decay: dict[int, float] = {}
    for group in optimizer.param_groups:
        if group.get("weight_decay", 0.0):
            decay.update(
                {numbers[id(p)]: float(group["weight_decay"]) for p in group["params"] if id(p) in numbers}
            )
    return decay


class FrozenVarianceStep:
    """The optimizer's step for the compressed steps (see the module docstring), as a step
    pre-hook of the optimizer.

    Args:
        optimizer: the Adam or AdamW the user built.
        numbers: ``id(parameter) -> number`` of the model's parameters.
        warmup_steps: dense steps before the variance is frozen.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, numbers: dict[int, int], warmup_steps: int) -> None:
        if warmup_steps < 1:
            raise InvalidOptionError(
                "compressed Adam needs a dense warm-up that gives the second moment its values: pass "
                "warmup_steps >= 1 (1-bit Adam uses 15-25% of the run; docs/choosing.md has what was measured here)"
            )
        self.optimizer = optimizer
        self.numbers = numbers
        self.warmup_steps = warmup_steps
        self.beta1 = check_adam(optimizer, numbers)
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        #: Set by the hook when a compressed step was committed: the next optimizer step is ours.
        self.pending = False
        self._preconditioners: dict[int, torch.Tensor] = {}
        self._handle = optimizer.register_step_pre_hook(self)

    def detach(self) -> None:
        """Stop taking over the optimizer's steps."""
        self._handle.remove()

    def compressing(self, step: int) -> bool:
        """Whether hook step ``step`` (0-based) is a compressed one (after the warm-up)."""
        return step >= self.warmup_steps

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: apply the compressed update to the model's parameters and clear
        their ``.grad`` (so the optimizer's own step skips them)."""
        if not self.pending:
            return
        self.pending = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr, decay = float(group["lr"]), float(group["weight_decay"])
                for param in group["params"]:
                    if id(param) not in self.numbers or param.grad is None:
                        continue
                    if self.decoupled and decay:
                        param.mul_(1.0 - lr * decay)
                    param.addcdiv_(param.grad.to(param.dtype), self._preconditioner(param, group), value=-lr)
                    param.grad = None

    def _preconditioner(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``sqrt(v / (1 - beta2^t)) + eps`` of the warm-up's last step (cached: it is frozen)."""
        cached = self._preconditioners.get(id(param))
        if cached is None:
            state = self.optimizer.state.get(param, {})
            if "exp_avg_sq" not in state:
                raise InvalidOptionError(
                    "a parameter reached a compressed Adam step without a second moment (it had no gradient "
                    "during the dense warm-up): raise warmup_steps, or exclude it from the DDP model"
                )
            beta2, eps = float(group["betas"][1]), float(group["eps"])
            correction = 1.0 - beta2 ** _host_step(state["step"])
            cached = (state["exp_avg_sq"] / correction).sqrt_().add_(eps)
            self._preconditioners[id(param)] = cached
        return cached

    def initial_velocity(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The velocity a part starts its compressed steps with: the warm-up's bias-corrected
        first moment ``m / (1 - beta1^t)`` in velocity units (``/ (1 - beta1)``), flattened in
        ``params``' order (zeros for a parameter Adam never stepped); None without any."""
        pieces, found = [], False
        for param in params:
            state = self.optimizer.state.get(param, {})
            if "exp_avg" in state:
                found = True
                correction = (1.0 - self.beta1) * (1.0 - self.beta1 ** _host_step(state["step"]))
                pieces.append((state["exp_avg"].reshape(-1) / correction).float())
            else:
                pieces.append(torch.zeros(param.numel(), dtype=torch.float32, device=param.device))
        return torch.cat(pieces) if found else None

    def moment_scale(self) -> float:
        """What the exchange's mean (velocity units) is multiplied by to give Adam's first moment."""
        return 1.0 - self.beta1


def _host_step(step: Any) -> float:
    """Adam's step count as a float (a CPU tensor unless ``capturable``): read once per
    parameter, when the variance is frozen, in the optimizer's step -- not during backward."""
    return float(step)
