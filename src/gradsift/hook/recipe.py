"""DGC's recipe for sparse training (Lin et al. 2018), as the hook applies it.

Sparsification with error feedback delays each element's update until it is sent;
plain SGD momentum on top of that multiplies stale updates. Deep Gradient Compression
fixes it with four techniques, all available as hook options:

* **Momentum correction** (``optimizer=``): the worker accumulates the velocity
  ``u <- m u + g`` before error feedback (:mod:`gradsift.hook.feedback`), and the optimizer
  runs without momentum. :func:`take_over` moves SGD's ``momentum`` (and its
  ``weight_decay``, which SGD folds into the gradient *before* momentum) from the
  optimizer's parameter groups into the hook, so momentum is applied exactly once.
  The group keeps the values under ``gradsift_momentum`` / ``gradsift_weight_decay``
  (and ``momentum = weight_decay = 0``), so an optimizer checkpoint carries the
  arrangement and a resumed run gets the same result whichever of
  ``optimizer.load_state_dict`` and ``register_comm_hook`` comes first. An SGD that already
  stepped hands its momentum buffers over as the velocity's start. With nothing
  dropped (ratio 1, no masking) the hook then equals stock DDP + SGD momentum:
  ``mean_w(m u_w + g_w + wd x) = m mean_w(u_w) + mean_w(g_w) + wd x``. An SGD without
  momentum keeps both: nothing enters a momentum, and SGD decays the parameters after the
  exchange as with stock DDP, once per step however many backward passes exchanged and
  whatever schedule sets the decay.
* **Momentum factor masking** (``momentum_masking``, on by default): ``u[sent] = 0``.
* **Local gradient clipping** (``clip_norm=c``): before accumulation, each part's local
  gradient is scaled by ``min(1, t / ||g||)`` with ``t = c * sqrt(n_part / n_model) / sqrt(W)``
  (the hook sees one part at a time: the per-part thresholds' squares sum to
  ``c^2 / W``, DGC's ``N^{-1/2}`` scaling of the threshold).
* **Warm-up of the density** (``density_warmup_steps=T``, ``density_warmup_start=d0``):
  the sparsifier's ratio goes exponentially from ``d0`` to the target ``d``,
  ``d0 (d / d0)^(t / T)`` at step ``t < T`` (DGC: 25% to 0.1% in four epochs).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.bucket_order import flat_like, shaped_like
from gradsift.core.errors import InvalidOptionError
from gradsift.core.precision import working_dtype
from gradsift.core.store import Canonical
from gradsift.hook import discovery
from gradsift.hook.adam import (
    ADAM_FAMILY,
    AdamStep,
    FrozenVarianceStep,
    OneBitAdamStep,
    check_adam,
    is_adam,
    l2_decay,
)
from gradsift.hook.local_update import LocalUpdateStep
from gradsift.hook.param_groups import model_groups
from gradsift.hook.zero_one import DEFAULT_LOCAL_STEPS, LocalSteps, ZeroOneAdamStep

MOMENTUM_KEY = "gradsift_momentum"
WEIGHT_DECAY_KEY = "gradsift_weight_decay"


@dataclass
class Takeover:
    """What the hook took from the optimizer: one momentum, weight decay per parameter number,
    and for Adam/AdamW the optimizer step of the compressed phase (:mod:`gradsift.hook.adam`)."""

    momentum: float = 0.0
    weight_decay: dict[int, float] = field(default_factory=dict)
    adam: AdamStep | None = None
    #: SGD's momentum buffers, taken out of its state (an SGD that already stepped): the velocity's start.
    velocity: dict[int, torch.Tensor] = field(default_factory=dict)


SUPPORTED_OPTIMIZERS = "torch.optim.SGD (with momentum or without), torch.optim.Adam, torch.optim.AdamW"


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper steps (Accelerate's ``AcceleratedOptimizer`` keeps it as
    ``.optimizer``), or ``optimizer`` itself."""
    inner = getattr(optimizer, "optimizer", None)
    while not isinstance(optimizer, (torch.optim.SGD, *ADAM_FAMILY)) and isinstance(
        inner, torch.optim.Optimizer
    ):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def take_over(
    optimizer: Any,
    numbers: dict[int, int],
    warmup_steps: int | None = None,
    adam: str = "frozen-variance",
    compressor: Compressor | None = None,
    local_steps: LocalSteps | None = None,
) -> Takeover:
    """Move the optimizer's first moment (and the weight decay that enters it) into the hook.

    SGD: its ``momentum`` and ``weight_decay`` (module docstring). Adam/AdamW: the method
    ``adam`` of :mod:`gradsift.hook.adam` takes the optimizer's steps after ``warmup_steps`` dense
    ones (None: a frozen method's measured warm-up, none for ``"update"``; ``"frozen-variance"``,
    ``"onebit"``: ``beta1`` becomes the velocity's momentum; ``"update"``: each worker's own Adam
    update travels, with no momentum in the exchange; ``"zero-one"``: the frozen variance with
    0/1 Adam's ``local_steps`` (:mod:`gradsift.hook.zero_one`), its velocity its own).
    ``numbers`` maps ``id(parameter)`` to the parameter's number. A ``compressor`` whose
    :attr:`~gradsift.compressors.base.Compressor.momentum_correction` is False (PowerSGD) takes
    nothing from SGD or the Adam family: the optimizer keeps its moments and steps on the
    exchanged mean, and an ``adam`` other than the default ``"frozen-variance"`` is refused (a
    low-rank velocity's error comes back in bursts: docs/decisions.md, "PowerSGD leaves Adam to
    the optimizer"). Raises
    :class:`InvalidOptionError` for an optimizer holding none of the model's parameters, for other
    optimizers, for Nesterov momentum or dampening,
    for ``maximize=True`` with weight decay, for groups that disagree on momentum, and for a
    group that also holds parameters outside the model (:func:`foreign_parameters`: their
    momentum would go too).
    """
    optimizer = unwrapped(optimizer)
    if next(model_groups(optimizer, numbers), None) is None:
        raise InvalidOptionError(
            f"optimizer= ({type(optimizer).__name__}) holds none of the hooked model's parameters: "
            "pass the optimizer that steps them (or leave optimizer= out: the hook finds it)"
        )
    if compressor is not None and not compressor.momentum_correction:  # the optimizer keeps its moments
        if is_adam(optimizer) and adam != "frozen-variance":
            raise InvalidOptionError(
                f"adam={adam!r} runs an Adam method in the hook, but {compressor.name!r} leaves "
                f"{type(optimizer).__name__} its moments (it compresses the gradient, not a momentum): "
                "drop adam=, or pick an error-feedback compressor that takes the first moment over (e.g. efsignsgd)"
            )
        return Takeover()
    if (is_adam(optimizer) or isinstance(optimizer, torch.optim.SGD)) and discovery.cycles_momentum(
        optimizer
    ):
        raise InvalidOptionError(
            f"a scheduler cycles {type(optimizer).__name__}'s {momentum_name(optimizer)} (OneCycleLR's and "
            f"CyclicLR's default): {CYCLED_MOMENTUM}"
        )
    if is_adam(optimizer):
        step = _adam_step(optimizer, numbers, warmup_steps, adam, local_steps)
        momentum = 0.0 if isinstance(step, (LocalUpdateStep, ZeroOneAdamStep)) else step.beta1
        return Takeover(momentum=momentum, weight_decay=l2_decay(optimizer, numbers), adam=step)
    if not isinstance(optimizer, torch.optim.SGD):
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # imported if in use
        sharded = zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)
        sharded_note = (
            " (ZeroRedundancyOptimizer shards the state the hook would take over)" if sharded else ""
        )
        raise InvalidOptionError(
            f"optimizer= supports {SUPPORTED_OPTIMIZERS}; got {type(optimizer).__name__}{sharded_note} "
            "(LAMB, Adafactor, Lion and the like are not supported: pass optimizer=False for error feedback "
            "without momentum correction, or a compressor without error feedback)"
        )
    groups, momentum = _sgd_takeover(optimizer, numbers)  # every refusal before any group changes
    if not momentum:  # nothing enters a momentum: SGD keeps its decay (module docstring)
        return Takeover()
    taken = Takeover(momentum=momentum, velocity=take_momentum_buffers(optimizer, numbers))
    _move_into_hook(groups, taken.weight_decay)
    return taken


#: Why a cycled momentum is refused, and what to do instead.
CYCLED_MOMENTUM = "the hook applies one fixed momentum; build the scheduler with cycle_momentum=False"


def momentum_name(optimizer: Any) -> str:
    """What the optimizer calls the momentum a scheduler cycles: SGD's ``momentum``, Adam's first beta."""
    return "first beta (betas[0])" if is_adam(unwrapped(optimizer)) else "momentum"


def _adam_step(
    optimizer: torch.optim.Optimizer,
    numbers: dict[int, int],
    warmup_steps: int | None,
    method: str,
    local_steps: LocalSteps | None,
) -> AdamStep:
    """The takeover of ``method`` (:data:`gradsift.hook.adam.METHODS`) for an Adam-family
    ``optimizer``; the frozen methods measure their warm-up when ``warmup_steps`` is None,
    ``"update"`` has none then."""
    if method == "update":
        return LocalUpdateStep(optimizer, numbers, warmup_steps or 0)
    if method == "zero-one":
        return ZeroOneAdamStep(optimizer, numbers, warmup_steps, local_steps or DEFAULT_LOCAL_STEPS)
    if method == "onebit":
        return OneBitAdamStep(optimizer, numbers, warmup_steps)
    return FrozenVarianceStep(optimizer, numbers, warmup_steps)


def take_over_added(optimizer: Any, numbers: dict[int, int], start: int) -> dict[int, float]:
    """:func:`take_over` of the SGD groups from index ``start`` on, added to an optimizer whose
    first ``start`` groups were taken over (``add_param_group``): every group is checked as
    :func:`take_over` checks them -- so an added group's momentum must be the hook's, which the
    taken groups keep under ``gradsift_momentum`` --, then the added ones' momentum and weight
    decay move into the hook. Returns their weight decays per parameter number."""
    optimizer = unwrapped(optimizer)
    groups, _ = _sgd_takeover(optimizer, numbers)
    added = {id(group) for group in optimizer.param_groups[start:]}
    decays: dict[int, float] = {}
    _move_into_hook([entry for entry in groups if id(entry[0]) in added], decays)
    return decays


def _move_into_hook(
    groups: list[tuple[dict[str, Any], list[int], float, float]], decays: dict[int, float]
) -> None:
    """Leave momentum and weight decay 0 in each of :func:`_sgd_groups`' ``groups``, their values
    kept under the hook's keys, and each nonzero decay in ``decays`` per parameter number."""
    for group, mine, momentum, decay in groups:
        group[MOMENTUM_KEY], group["momentum"] = momentum, 0.0
        if "weight_decay" in group:
            group[WEIGHT_DECAY_KEY], group["weight_decay"] = decay, 0.0
        if decay:
            decays.update(dict.fromkeys(mine, decay))


def can_hold(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a wrapper holds) is of a kind :func:`take_over` takes:
    :data:`SUPPORTED_OPTIMIZERS`. Discovery adopts no other kind for error feedback, so the
    first step's check names it instead of a refusal of an ``optimizer=`` never passed."""
    return isinstance(unwrapped(optimizer), (torch.optim.SGD, *ADAM_FAMILY))


def takes_over(optimizer: Any, numbers: dict[int, int]) -> bool:
    """Whether :func:`take_over` accepts the settings of ``optimizer`` (SGD or the Adam family) for
    the model's parameters ``numbers``, checked without changing anything: what the one line
    asks before it picks a method that takes the momentum over."""
    inner = unwrapped(optimizer)
    try:
        check_adam(inner, numbers) if is_adam(inner) else _sgd_takeover(inner, numbers)
    except InvalidOptionError:
        return False
    return True


def _sgd_takeover(
    optimizer: Any, numbers: dict[int, int]
) -> tuple[list[tuple[dict[str, Any], list[int], float, float]], float]:
    """:func:`_sgd_groups` and their one momentum; raises for a group that also holds parameters
    outside the model (:func:`foreign_parameters`: their momentum would go too) and for groups
    that disagree on momentum."""
    foreign = foreign_parameters(optimizer, numbers)
    if foreign:
        index, count = next(iter(foreign.items()))
        raise InvalidOptionError(
            f"optimizer param group {index} holds {count} parameter(s) besides those DDP exchanges (another "
            "model's, or those DDP was told to ignore): momentum correction moves a group's momentum and "
            "weight decay into the hook, which would take them from those too; give the exchanged parameters "
            "groups of their own (SGD([{'params': exchanged}, {'params': others}], ...)), or pass optimizer=False"
        )
    groups = _sgd_groups(optimizer, numbers)
    momenta = {momentum for _, _, momentum, _ in groups}
    if len(momenta) > 1:
        raise InvalidOptionError(
            f"the model's parameter groups use different momenta {sorted(momenta)}: use one"
        )
    return groups, momenta.pop() if momenta else 0.0


def _sgd_groups(
    optimizer: Any, numbers: dict[int, int]
) -> list[tuple[dict[str, Any], list[int], float, float]]:
    """``(group, numbers, momentum, weight decay)`` of each SGD group holding the model's
    parameters, the values as built (or as a takeover left them); raises for a group whose
    momentum the hook cannot apply exactly (:func:`take_over`)."""
    found = []
    for index, group, mine in model_groups(optimizer, numbers):
        if "momentum" not in group:
            raise InvalidOptionError(
                f"optimizer= moves SGD-style momentum into the exchange, but {type(optimizer).__name__} "
                "has no 'momentum' setting; pass optimizer=False (error feedback without momentum correction)"
            )
        if group.get("nesterov") or group.get("dampening", 0):
            raise InvalidOptionError(
                f"optimizer param group {index}: momentum correction implements plain momentum; "
                "nesterov=True and dampening != 0 are not supported (build SGD without them, pass "
                "optimizer=False for error feedback without momentum correction, or leave the compressor "
                "to auto, which runs without a takeover then)"
            )
        momentum = float(group.get(MOMENTUM_KEY, group["momentum"]))
        decay = float(group.get(WEIGHT_DECAY_KEY, group.get("weight_decay", 0.0)))
        if decay and momentum and group.get("maximize"):
            raise InvalidOptionError(
                f"optimizer param group {index}: maximize=True with weight_decay: SGD adds the decay to "
                "the negated gradient, the hook to the gradient it exchanges; use one of them"
            )
        found.append((group, mine, momentum, decay))
    return found


def foreign_parameters(optimizer: Any, numbers: dict[int, int]) -> dict[int, int]:
    """Per parameter group of ``optimizer`` that holds some of the model's parameters
    (``numbers``: ``id(parameter) -> number``) and others too, how many others it holds."""
    counts = {
        index: sum(id(param) not in numbers for param in group["params"])
        for index, group, _ in model_groups(unwrapped(optimizer), numbers)
    }
    return {index: count for index, count in counts.items() if count}


def take_momentum_buffers(optimizer: Any, numbers: dict[int, int]) -> dict[int, torch.Tensor]:
    """SGD's momentum buffer per parameter number of the model, where it has one, removed from
    the optimizer's state: the velocity momentum correction starts from when it takes over a
    run that already stepped (the hook's ``u <- m u + g`` then continues ``buf <- m buf + g``),
    and which the optimizer, its momentum now 0, would keep unread."""
    optimizer = unwrapped(optimizer)
    return {
        numbers[id(param)]: flat_like(optimizer.state[param].pop("momentum_buffer"), param)
        for _, group, _ in model_groups(optimizer, numbers)
        for param in group["params"]
        if id(param) in numbers and optimizer.state.get(param, {}).get("momentum_buffer") is not None
    }


def give_back(
    optimizer: Any,
    numbers: dict[int, int],
    velocity: dict[int, torch.Tensor],
    residual: dict[int, torch.Tensor],
) -> None:
    """The inverse of :func:`take_over` for SGD, when the exchange goes back to a dense one.

    The groups get their ``momentum`` and ``weight_decay`` back; parameter ``i``'s momentum
    buffer becomes ``velocity[i]``, and what was never sent is applied once,
    ``x <- x - lr * residual[i]`` (both given as the mean over the workers). Why: with
    momentum correction the optimizer applied ``lr * sent`` each step, and every velocity a
    worker accumulated is either sent or still in its residual, so stock SGD momentum, which
    applies ``lr * mean_w(u_w)`` through its buffer, is ``mean_w(r_w)`` ahead; from here on
    ``buf <- m buf + g`` continues ``mean_w(u_w <- m u_w + g_w)``. Exact without momentum
    factor masking and at a constant learning rate (tests/hook/test_auto_drift.py: a dense
    exchange given back equals stock DDP); masking zeroes the sent elements' velocity, DGC's
    approximation, which the buffer then keeps.
    """
    optimizer = unwrapped(optimizer)
    with torch.no_grad():
        for _, group, _ in model_groups(optimizer, numbers):
            if MOMENTUM_KEY in group:
                group["momentum"] = group.pop(MOMENTUM_KEY)
            if WEIGHT_DECAY_KEY in group:
                group["weight_decay"] = group.pop(WEIGHT_DECAY_KEY)
            for param in group["params"]:
                number = numbers.get(id(param))
                if number in velocity and group["momentum"]:
                    buffer = shaped_like(velocity[number], param).to(param.dtype, copy=True)
                    optimizer.state[param]["momentum_buffer"] = buffer
                if number in residual:
                    param.sub_(shaped_like(residual[number], param).to(param.dtype), alpha=group["lr"])


def add_weight_decay(
    flat: torch.Tensor, params: Sequence[torch.Tensor], numbers: Sequence[int], decay: dict[int, float]
) -> None:
    """``g <- g + wd x`` in place, per parameter of a part (``params`` in flattening order) that
    requires grad: the optimizer skips a frozen one (no gradient, so no decay), which DDP hands
    the hook as zeros under ``find_unused_parameters``."""
    offset = 0
    for param, number in zip(params, numbers, strict=True):
        size = param.numel()
        if number in decay and param.requires_grad:
            shaped_like(flat[offset : offset + size], param).add_(param.detach(), alpha=decay[number])
        offset += size


def clip_local(
    flat: torch.Tensor,
    clip_norm: float,
    part_numel: int,
    model_numel: int,
    world: int,
    canonical: Canonical | None = None,
) -> torch.Tensor:
    """DGC's local clipping of one part (see the module docstring): ``flat * min(1, t / ||flat||)``,
    a new tensor, on the device (no host read); a non-finite norm leaves ``flat`` as it is.
    ``||flat||`` is :func:`canonical_norm`'s."""
    threshold = clip_norm * math.sqrt(part_numel / model_numel) / math.sqrt(world)
    norm = canonical_norm(flat, canonical)
    factor = torch.where(torch.isfinite(norm) & (norm > threshold), threshold / norm, 1.0)
    return flat * factor.to(flat.dtype)


def canonical_norm(flat: torch.Tensor, canonical: Canonical | None) -> torch.Tensor:
    """``||flat||`` on the device, in float32 or ``flat``'s dtype where that is wider (float64):
    with ``canonical`` (a DDP bucket's layout) the norm of the parameters' own norms taken in
    parameter-number order, ``sqrt(sum_i ||g_i||^2)``, so the same gradients give the same bits
    whichever order DDP lays them out in (it changes at DDP's rebuild and when a run resumes);
    one pass over ``flat`` either way."""
    dtype = working_dtype(flat.dtype)
    if canonical is None:
        return torch.linalg.vector_norm(flat, dtype=dtype)
    norms = torch._foreach_norm(flat.split(canonical.sizes), dtype=dtype)
    return torch.linalg.vector_norm(torch.stack([norms[j] for j in canonical.chunks]))


def density_at(step: int, target: float, warmup_steps: int, start: float) -> float:
    """The ratio at 0-based ``step``: ``start (target / start)^(step / warmup_steps)``, then ``target``."""
    if step >= warmup_steps or start <= target:
        return target
    return start * (target / start) ** (step / warmup_steps)
