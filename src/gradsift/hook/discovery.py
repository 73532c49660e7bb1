"""What the hook finds by itself: the optimizer that steps the hooked model and the loss scaler.

``register_comm_hook(ddp)`` with no ``optimizer=`` or ``scaler=`` looks for them at the
first bucket of the first backward, when a training script has built both (the hook is
usually registered before the optimizer exists). The search reads the live objects once
(:func:`gc.get_objects`, by exact type so no object's attributes are touched), on the host,
before any tensor of the step is touched:

* **the optimizer**: the one ``torch.optim.Optimizer`` whose parameter groups hold the
  hooked model's parameters. An optimizer a wrapper holds (Accelerate's, Hugging Face's)
  is found as the inner one, which is what the hook takes over anyway. None found, or
  several holding them (one per parameter subset, say): nothing is adopted, and the first
  optimizer step's check (:mod:`gradsift.hook.first_step`) names what it sees.
* **the scaler**: the one enabled ``torch.amp.GradScaler`` (or ``torch.cuda.amp``'s) that
  has scaled a loss (its scale exists). Several such: none is adopted.

Adopting them is exactly passing them: the same objects reach the same code before the
hook's first step (the tests compare both runs bit for bit). Explicit arguments are never
replaced; ``optimizer=None`` / ``scaler=None`` passed by hand still mean "look".
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch


def live_optimizers(params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """The live optimizers whose parameter groups hold any of ``params``, in creation order
    where known (the order of :func:`gc.get_objects`)."""
    wanted = {id(p) for p in params}
    found: dict[int, torch.optim.Optimizer] = {}  # one per parameter-group list: a wrapper shares its inner's
    for candidate in gc.get_objects():
        if issubclass(type(candidate), torch.optim.Optimizer) and _holds(candidate, wanted):
            groups = id(candidate.param_groups)
            if groups not in found or _wraps(found[groups], candidate):
                found[groups] = candidate
    return list(found.values())


def find_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The one live optimizer stepping ``params``; None when there is none or more than one."""
    found = live_optimizers(params)
    return found[0] if len(found) == 1 else None


def find_scaler() -> Any:
    """The one enabled ``GradScaler`` that has scaled a loss; None when there is none or several."""
    found = [
        candidate
        for candidate in gc.get_objects()
        if issubclass(type(candidate), torch.amp.GradScaler)
        and candidate.is_enabled()
        and getattr(candidate, "_scale", None) is not None
    ]
    return found[0] if len(found) == 1 else None


def _holds(optimizer: torch.optim.Optimizer, wanted: set[int]) -> bool:
    return any(id(p) in wanted for group in optimizer.param_groups for p in group["params"])


def _wraps(outer: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> bool:
    """``outer`` is a wrapper holding ``inner`` (as Accelerate's ``AcceleratedOptimizer.optimizer``)."""
    return getattr(outer, "optimizer", None) is inner
