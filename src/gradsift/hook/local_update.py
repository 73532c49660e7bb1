"""Adam's update travels (``adam="update"``): each worker runs Adam on its own gradient and sends
the normalised update with error feedback (:class:`LocalUpdateStep`); the other Adam methods,
which freeze the second moment, are :mod:`gradsift.hook.adam`'s."""

from __future__ import annotations

from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.precision import working_dtype
from gradsift.hook.adam import AdamStep
from gradsift.hook.param_groups import model_groups

#: State-store tables of :class:`LocalUpdateStep`: each worker's own Adam moments.
FIRST, SECOND = "adam.exp_avg", "adam.exp_avg_sq"


class LocalUpdateStep(AdamStep):
    """The update travels: each worker runs Adam on its own gradient (its own ``m``, ``v``, in
    the hook's state store) and sends the update ``m_hat / (sqrt(v_hat) + eps)`` with error
    feedback; the mean of what was sent is the step's direction. A coordinate that waited
    carries the sum of its skipped updates -- already normalised -- so it moves as far as
    it would have. No warm-up, nothing frozen; each worker's preconditioner sees only its
    own batch (its ``v`` is the mean square of a ``W`` times smaller batch's gradients).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, numbers: dict[int, int], warmup_steps: int = 0
    ) -> None:
        super().__init__(optimizer, numbers)
        self.warmup_steps = warmup_steps
        settings = {
            (tuple(float(b) for b in group["betas"]), float(group["eps"]))
            for _, group, _ in model_groups(optimizer, numbers)
        }
        if len(settings) != 1:
            raise InvalidOptionError(
                f"the model's parameter groups use different betas/eps {sorted(settings)}: use one"
            )
        ((_, self.beta2), self.eps) = settings.pop()

    def compressing(self, step: int) -> bool:
        """After the optional dense warm-up (the optimizer as built)."""
        return step >= self.warmup_steps

    def update(self, store: Any, key: Any, gradient: torch.Tensor, step: int) -> torch.Tensor:
        """This worker's Adam update of part ``key`` for its ``gradient`` at 0-based ``step``
        (the moments put into ``store``, which rolls them back with a dropped step)."""
        g = gradient.reshape(-1).to(working_dtype(gradient.dtype))
        first, second = store.get(FIRST, key), store.get(SECOND, key)
        first = (1.0 - self.beta1) * g if first is None else torch.lerp(first, g, 1.0 - self.beta1)
        second = (1.0 - self.beta2) * g * g if second is None else torch.lerp(second, g * g, 1.0 - self.beta2)
        store.put(FIRST, key, first)
        store.put(SECOND, key, second)
        t = step - self.warmup_steps + 1  # the moments start after the dense warm-up
        denominator = (second / (1.0 - self.beta2**t)).sqrt_().add_(self.eps)
        return first / (1.0 - self.beta1**t) / denominator
