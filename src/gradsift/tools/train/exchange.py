"""The gradient exchange of the trainer: gradsift's DDP hook, DGC's recipe, per-step numbers.

With the recipe on (the trainer's default, ``--no-recipe`` turns it off), the hook gets
``optimizer=`` -- for a compressor with error feedback, SGD's momentum moves into the
exchange (DGC's momentum correction, with momentum factor masking) and the optimizer
runs without it; for the others the optimizer keeps its momentum -- and an
error-feedback sparsifier with a ratio warms its density up exponentially from 0.25 to
the target over the first :data:`DENSITY_WARMUP_FRACTION` of the run's steps
(:mod:`gradsift.hook.recipe`). Options given explicitly (e.g. ``density_warmup_steps=0``)
win over the recipe's defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gradsift.compressors.base import Sparsifier
from gradsift.compressors.registry import compressor_class
from gradsift.frontends.ddp import register_comm_hook
from gradsift.frontends.diloco import OUTER_OPTIONS, diloco
from gradsift.hook.adam import default_warmup_steps
from gradsift.hook.auto import AUTO

#: Share of the run's steps over which the recipe warms the density up (docs/decisions.md).
DENSITY_WARMUP_FRACTION = 0.025

#: Keys of the per-step dict :func:`install_exchange`'s callable returns.
EXCHANGE_FIELDS = (
    "compress_s",
    "communicate_s",
    "decompress_s",
    "bytes_sent",
    "bytes_padded",
    "bytes_received",
    "dense_bytes",
    "density",
)


def warms_up_density(compressor: str, options: dict[str, Any]) -> bool:
    """Whether the recipe's density warm-up applies: a sparsifier that takes a ``ratio``
    and runs with error feedback (its own, unless ``error_feedback=`` says otherwise)."""
    cls = compressor_class(compressor)
    takes_ratio = "ratio" in inspect.signature(cls.__init__).parameters
    return issubclass(cls, Sparsifier) and takes_ratio and uses_feedback(compressor, options)


def recipe_options(
    compressor: str, options: dict[str, Any], steps: int, adam: bool = False
) -> dict[str, Any]:
    """The hook options with the recipe's density warm-up added where it applies, over
    ``round(DENSITY_WARMUP_FRACTION * steps)`` steps (none for runs of 20 steps or fewer,
    where that rounds to 0; with ``auto`` outside the Adam family, for the sparsifier its
    measuring steps run, :data:`gradsift.hook.choice.START`), and with ``adam`` (an Adam-family optimizer) and an
    error-feedback compressor that takes the first moment over (not PowerSGD, which leaves Adam
    its moments: :func:`gradsift.hook.recipe.take_over`) the dense warm-up of
    :func:`gradsift.hook.adam.default_warmup_steps` (a tenth of the steps, at least 1); explicit
    options win."""
    hook_options = dict(options)
    warmup_steps = round(DENSITY_WARMUP_FRACTION * steps)
    if compressor == AUTO:  # Adam's dense warm-up, or the density warm-up of SGD's start method
        if adam:
            hook_options.setdefault("warmup_steps", default_warmup_steps(steps))
        elif warmup_steps:
            hook_options.setdefault("density_warmup_steps", warmup_steps)
        return hook_options
    if warmup_steps and warms_up_density(compressor, options):
        hook_options.setdefault("density_warmup_steps", warmup_steps)
    if adam and uses_feedback(compressor, options) and compressor_class(compressor).momentum_correction:
        hook_options.setdefault("warmup_steps", default_warmup_steps(steps))
    return hook_options


def uses_feedback(compressor: str, options: dict[str, Any]) -> bool:
    """Whether the compressor runs with error feedback (its own default, or ``error_feedback=``)."""
    feedback = options.get("error_feedback")
    return bool(compressor_class(compressor).error_feedback if feedback is None else feedback)


def install_exchange(
    ddp_model: DistributedDataParallel,
    compressor: str,
    options: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    steps: int,
    recipe: bool = True,
) -> tuple[Callable[[], dict[str, float]], dict[str, Any]]:
    """Register gradsift's hook on ``ddp_model`` -- with DGC's recipe (module docstring)
    for a run of ``steps``, or with ``options`` only (``recipe=False``: the optimizer
    keeps its momentum). Returns a function giving the last step's exchange numbers
    (:func:`step_exchange_stats`) and the recipe in use (:func:`recipe_in_use`)."""
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    hook_options = recipe_options(compressor, options, steps, adam) if recipe else dict(options)
    if compressor == AUTO:
        hook_options["steps"] = steps  # the run's length: the 1-bit Adam method is a candidate in long runs
    state = register_comm_hook(
        ddp_model, compressor, optimizer=optimizer if recipe else False, **hook_options
    )
    in_use = recipe_in_use(state, optimizer, recipe)

    def stats() -> dict[str, float]:
        numbers = state.stats()
        for chosen in ("auto", "adam_warmup"):  # what auto chose, when Adam's warm-up ended: summary.json
            if chosen in numbers:
                in_use[chosen] = numbers[chosen]
        return step_exchange_stats(numbers["step"])

    return stats, in_use


def install_diloco(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Any
) -> tuple[Callable[[], dict[str, float]], dict[str, Any], Callable[[], None]]:
    """Train with ``gradsift.diloco`` every ``config.sync_every`` inner steps (no DDP). Returns
    the per-step exchange numbers (a round's on the step that ended it, nothing on the
    others; ``dense_bytes`` is what DDP would have sent that step), what runs (for
    ``summary.json``), and a function that ends an unfinished round (the run's last step)."""
    named = {} if config.compressor == AUTO else {"compressor": config.compressor}  # auto: DiLoCo's default
    state = diloco(model, optimizer, sync_every=config.sync_every, **named, **config.options)
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    seen = {"rounds": 0}

    def stats() -> dict[str, float]:
        if state.rounds == seen["rounds"]:
            return {**dict.fromkeys(EXCHANGE_FIELDS, 0.0), "dense_bytes": float(dense), "density": 0.0}
        seen["rounds"] = state.rounds
        return {**step_exchange_stats(state.hook.stats()["step"]), "dense_bytes": float(dense)}

    def finish_round() -> None:
        if state.inner_steps % state.sync_every:
            state.sync()

    outer = {name: config.options[name] for name in OUTER_OPTIONS if name in config.options}
    recipe = {
        "enabled": False,
        "optimizer": type(optimizer).__name__,
        "diloco": {"sync_every": config.sync_every, "compressor": state.hook.compressor.name, **outer},
    }
    return stats, recipe, finish_round


def install_own_exchange(optimizer: Any) -> tuple[Callable[[], dict[str, float]], dict[str, Any]]:
    """Train with an optimizer whose step is the exchange (:class:`gradsift.DeMo`,
    :class:`gradsift.DistributedLion`; no DDP). Returns the per-step exchange numbers (its
    ``stats()``, as the hook's) and what runs (for ``summary.json``: its options under its key,
    ``demo`` or ``lion``)."""

    def stats() -> dict[str, float]:
        return step_exchange_stats(optimizer.stats()["step"])

    return stats, {
        "enabled": False,
        "optimizer": type(optimizer).__name__,
        optimizer.key: optimizer.options.describe(),
    }


def recipe_in_use(state: Any, optimizer: torch.optim.Optimizer, enabled: bool) -> dict[str, Any]:
    """What the run applies, for ``summary.json``: whether the recipe is on, the momentum
    inside the exchange (momentum correction; None without error feedback) and the one
    left in the optimizer, momentum factor masking (None without momentum correction),
    Adam's dense warm-up (the steps given; None: measured, then ``adam_warmup`` holds its end)
    and the density warm-up (steps; start density, None without a warm-up)."""
    feedback = state.feedback
    correcting = feedback is not None and feedback.momentum > 0
    warmup = state.options.density_warmup_steps
    return {
        "enabled": enabled,
        "hook_momentum": None if feedback is None else feedback.momentum,
        "optimizer": type(optimizer).__name__,
        "optimizer_momentum": optimizer.param_groups[0].get("momentum"),
        "adam_warmup_steps": state.options.warmup_steps if state.adam is not None else None,
        "momentum_masking": feedback.momentum_masking if correcting else None,
        "density_warmup_steps": warmup,
        "density_warmup_start": state.options.density_warmup_start if warmup else None,
    }


def step_exchange_stats(step: dict[str, Any]) -> dict[str, float]:
    """The hook's last-step statistics in seconds and bytes.

    ``bytes_sent`` is this worker's message (data + headers); ``bytes_padded`` adds the
    padding an allgather sends to match the longest worker; ``bytes_received`` is what
    arrives at this worker under the collectives' bandwidth-optimal algorithms; ``dense_bytes`` is the
    uncompressed gradient. Phase times are the hook's host wall-clock sums over buckets
    (buckets overlap backward and each other).
    """
    return {
        "compress_s": step["compress_ms"] / 1e3,
        "communicate_s": step["communicate_ms"] / 1e3,
        "decompress_s": step["decompress_ms"] / 1e3,
        "bytes_sent": float(step["bytes_sent"]),
        "bytes_padded": float(step["bytes_padded"]),
        "bytes_received": float(step["bytes_received"]),
        "dense_bytes": float(step["dense_bytes"]),
        "density": float(step["density"]),
    }
