"""What the hook finds by itself: the optimizer that steps the hooked model and the loss scaler.

``register_comm_hook(ddp)`` with no ``optimizer=`` or ``scaler=`` looks for them at the
first bucket of the first backward, when a training script has built both (the hook is
usually registered before the optimizer exists). The search reads the live objects once
(:func:`gc.get_objects`, by exact type so no object's attributes are touched), on the host,
before any tensor of the step is touched (:func:`find`):

* **the optimizer**: the one ``torch.optim.Optimizer`` whose parameter groups hold the
  hooked model's parameters. An optimizer a wrapper holds (Accelerate's, Hugging Face's)
  is found as the inner one, which is what the hook takes over anyway. None found, or
  several holding them (one per parameter subset, say), or, for a method with error feedback,
  one of a kind no method takes over (:func:`gradsift.hook.recipe.can_hold`: LBFGS, RMSprop, ...):
  nothing is adopted, and the first optimizer step's check (:mod:`gradsift.hook.first_step`)
  names what it sees, after the hook's first exchange (a closure's backward runs inside the
  step).
* **the scaler**: the one enabled ``torch.amp.GradScaler`` (or ``torch.cuda.amp``'s) that
  has scaled a loss (its scale exists) and had not when the hook was registered
  (:func:`scalers_that_scaled`): one that had is an earlier run's, still alive (a notebook's
  variable, garbage not yet collected), and adopting it would scale the hook's weight decay
  and clipping by its scale. Several such: none is adopted. A script that registers the hook
  after its scaler's first step passes ``scaler=`` (the first step's check asks for it).

And, for ``compressor="auto"`` (:mod:`gradsift.hook.choice`), whether a live learning-rate
scheduler cycles the found optimizer's momentum (:func:`cycles_momentum`): a momentum the hook
took over would then change under it.

Adopting them is exactly passing them: the same objects reach the same code before the
hook's first step (the tests compare both runs bit for bit). Explicit arguments are never
replaced; ``optimizer=None`` / ``scaler=None`` passed by hand still mean "look".
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch

#: Per optimizer, whether a scheduler cycles its momentum, as first looked up (:func:`cycles_momentum`).
_CYCLED: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()


def scalers_that_scaled() -> weakref.WeakSet[Any]:
    """The enabled ``GradScaler`` objects alive now that have scaled a loss (held weakly): what
    :func:`find` passes over for a hook registered now."""
    return weakref.WeakSet(
        candidate
        for candidate in gc.get_objects()
        if issubclass(type(candidate), torch.amp.GradScaler) and _has_scaled(candidate)
    )


def find(
    params: Iterable[torch.Tensor] | None, scaler: bool, earlier: Iterable[Any] = ()
) -> tuple[torch.optim.Optimizer | None, Any]:
    """One walk over the live objects: the one optimizer whose parameter groups hold any of
    ``params`` (not looked for when ``params`` is None) and, with ``scaler``, the one enabled
    ``GradScaler`` that has scaled a loss, but those of ``earlier`` (:func:`scalers_that_scaled`
    when the hook was registered); each None where there is none or more than one (an
    optimizer a wrapper holds counts once, as the inner one)."""
    earlier = list(earlier)
    wanted = None if params is None else {id(p) for p in params}
    optimizers: dict[
        int, torch.optim.Optimizer
    ] = {}  # one per parameter-group list: a wrapper shares its inner's
    scalers = []
    for candidate in gc.get_objects():
        kind = type(candidate)
        if wanted is not None and issubclass(kind, torch.optim.Optimizer) and _holds(candidate, wanted):
            groups = id(candidate.param_groups)
            if groups not in optimizers or _wraps(optimizers[groups], candidate):
                optimizers[groups] = candidate
        elif scaler and issubclass(kind, torch.amp.GradScaler) and _has_scaled(candidate):
            scalers += [] if any(candidate is old for old in earlier) else [candidate]
    return _the_one(list(optimizers.values())), _the_one(scalers)


def _the_one(found: list[Any]) -> Any:
    return found[0] if len(found) == 1 else None


def _has_scaled(scaler: Any) -> bool:
    return bool(scaler.is_enabled()) and getattr(scaler, "_scale", None) is not None


def _holds(optimizer: torch.optim.Optimizer, wanted: set[int]) -> bool:
    return any(id(p) in wanted for group in optimizer.param_groups for p in group["params"])


def _wraps(outer: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> bool:
    """``outer`` is a wrapper holding ``inner`` (as Accelerate's ``AcceleratedOptimizer.optimizer``)."""
    return getattr(outer, "optimizer", None) is inner


def cycles_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a live ``LRScheduler`` with ``cycle_momentum`` (``OneCycleLR``'s and ``CyclicLR``'s
    default) drives ``optimizer`` or a wrapper of it: one walk over the live objects the first time
    an optimizer is asked about, the answer kept for it."""
    if optimizer not in _CYCLED:
        scheduler = torch.optim.lr_scheduler.LRScheduler
        _CYCLED[optimizer] = any(
            issubclass(type(candidate), scheduler)
            and getattr(candidate, "cycle_momentum", False)
            and optimizer in (candidate.optimizer, getattr(candidate.optimizer, "optimizer", None))
            for candidate in gc.get_objects()
        )
    return _CYCLED[optimizer]
