"""The hook's options: one frozen, validated record, and the split of a frontend's keywords.

``register_comm_hook(model, compressor, **options)`` takes the hook's knobs and the
compressor's in one keyword list: :data:`HOOK_OPTIONS` names the hook's (the fields of
:class:`HookOptions` plus ``process_group`` and ``optimizer``), every other keyword goes
to the compressor (:func:`resolve_compressor`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gradsift.compressors.base import Compressor
from gradsift.compressors.registry import compressor_options, get_compressor, unknown_options
from gradsift.core.errors import InvalidOptionError
from gradsift.core.spelling import closest, did_you_mean
from gradsift.core.validation import check_bool, check_choice, check_int, check_ratio, check_real
from gradsift.core.wire import parse_value_dtype
from gradsift.exchanges import AUTO, available_exchanges
from gradsift.hook.adam import FROZEN_METHODS
from gradsift.hook.adam import METHODS as ADAM_METHODS
from gradsift.hook.layout import GRANULARITIES
from gradsift.hook.ledger import NONFINITE_POLICIES
from gradsift.hook.variance_refresh import parse_windows
from gradsift.hook.zero_one import parse_local_steps


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """The hook's knobs, validated once, then frozen (a change is ``dataclasses.replace``).

    Attributes:
        granularity: ``"bucket"`` (default) -- one ``compress`` per DDP bucket;
            ``"layer"`` -- one per parameter, so every layer gets its own selection.
        min_numel: parts with fewer elements go dense (default 0).
        warmup_steps: the first this many steps are dense, like PowerSGD's
            ``start_powerSGD_iter``. None (default): none, except under an Adam/AdamW optimizer
            (given or found) with ``adam="frozen-variance"`` or ``"onebit"`` and a compressor that
            takes the first moment over (not ``powersgd``), whose frozen
            second moment needs dense steps first: then the warm-up lasts until Adam's second
            moment has settled, measured on the run (:mod:`gradsift.hook.adam_warmup`; the
            hook's ``stats()["adam_warmup"]`` says when and why it ended). ``0`` means no dense
            step (refused under those Adam methods, which would have no second moment to freeze).
        value_dtype: dtype of sent values: None (default) keeps the compressor's, or
            ``"fp32"``/``"fp16"``/``"bf16"``. Dense parts travel in the gradient's dtype.
        nonfinite: what a step with NaN/Inf on any rank becomes, on every rank:
            ``"propagate"`` (default) -- the gradients DDP writes are NaN, as with stock
            DDP, so ``torch.amp.GradScaler`` skips the step and backs off its scale;
            ``"skip"`` -- they are all zero; ``"raise"`` -- :class:`NonFiniteGradientError`
            from ``backward()``. In every mode the step leaves no trace in any state
            (see :mod:`gradsift.hook.ledger`).
        error_feedback: None (default) = the compressor's ``error_feedback``; True/False forces it
            (True is refused with a compressor that keeps its own residual, ``vgc``).
        momentum: DGC momentum correction factor, set by hand (default 0; ``optimizer=``
            sets it from the optimizer instead).
        momentum_masking: DGC's momentum factor masking (default True).
        clip_norm: DGC's local gradient clipping threshold (None = off); see :mod:`gradsift.hook.recipe`.
        density_warmup_steps: steps over which a sparsifier's ratio goes exponentially
            from ``density_warmup_start`` to its target (default 0 = off).
        density_warmup_start: the density the warm-up starts from (default 0.25, DGC's).
        exchange: ``"auto"`` (default: the compressor's first supported exchange that delivers
            exactly the mean of every worker's selection -- the allgather for the sparsifiers;
            never ``"balanced"`` or ``"shared-mask"``, which approximate the mean and cost
            accuracy: :mod:`gradsift.exchanges.choice`) or one of
            :func:`gradsift.exchanges.available_exchanges` that the compressor supports.
        scaler: the ``torch.amp.GradScaler`` that scales the loss (None: no loss scaling);
            the hook then works on unscaled gradients (see the module docstring).
        adam: with ``optimizer=`` Adam/AdamW, the method of :mod:`gradsift.hook.adam`:
            ``"frozen-variance"`` (default; its dense warm-up is ``warmup_steps``), ``"onebit"``
            (the same with 1-bit Adam's momentum, restarted every step from the exchanged one),
            ``"zero-one"`` (the frozen variance with 0/1 Adam's local steps between
            synchronisations, :mod:`gradsift.hook.zero_one`) or ``"update"``. With a compressor
            that takes no momentum over (``powersgd``) the optimizer keeps its moments and no
            method runs: only the default is accepted (:func:`gradsift.hook.recipe.take_over`).
        local_steps: with ``adam="zero-one"``, ``(double_every, longest)``: one step between
            synchronisations over the first ``double_every`` compressed steps, then 2, 4, ... up
            to ``longest``; None (default): :data:`gradsift.hook.zero_one.DEFAULT_LOCAL_STEPS`.
            Refused with another method.
        warmup_compressor: None (default) -- a frozen-variance Adam method's warm-up is stock
            DDP's fp32 allreduce; a deterministic quantizer (a registry name with its default
            options, e.g. ``"blockquant"``'s 4-bit codes, or an instance) -- the warm-up's
            gradients travel in its codes with error feedback instead
            (:mod:`gradsift.hook.warmup_code`). Refused without such a method.
        variance_refresh: ``()`` (default) -- a frozen-variance Adam method's second moment stays
            as its warm-up left it; ``((start, steps), ...)`` -- over each window of hook
            steps the gradients also travel as in the warm-up and the second moment becomes
            the mean of their means' squares (:mod:`gradsift.hook.variance_refresh`). Needs
            ``warmup_steps=``; refused without such a method.
        residual_decay: error feedback's ``beta`` in ``c = g + beta r``; None (default): the
            compressor's own :attr:`~gradsift.compressors.base.Compressor.residual_decay`
            (1, plain error feedback, except random-k's 0.95).
        server_feedback: 1-bit Adam's server-side error feedback (default False): after the
            exchange's mean ``s`` of a compressed part, every rank computes
            ``c = C(s + e)`` with the compressor ``C``, keeps ``e <- s + e - c`` and uses
            ``c`` (:func:`gradsift.hook.feedback.server_stage`). No extra bytes: every rank
            holds the same ``s``, so the same ``e`` and ``c``. Needs a compressor whose
            ``server_stage`` is True (``signsgd``, ``efsignsgd``, ``onebit``) and an exchange
            that hands every rank the same mean (the allgather); refused otherwise.
        padding_target: for a compressor whose payload's capacity follows its demand
            (``vgc``, ``threshold``): None (default) -- each capacity is the last step's
            largest demand; a number >= 1 -- the room over entries sent that the
            capacities aim for, by sending at most a fraction of that demand (entries
            beyond the room wait in the residual; :mod:`gradsift.hook.capacity`).
            Refused for the other compressors.
        log_every: log every this many steps (``gradsift.hook`` logger, INFO); 0 = off.
        jsonl_path: also append each logged step to this JSON-lines file.
    """

    granularity: str = "bucket"
    min_numel: int = 0
    warmup_steps: int | None = None
    value_dtype: Any = None
    nonfinite: str = "propagate"
    error_feedback: bool | None = None
    momentum: float = 0.0
    momentum_masking: bool = True
    clip_norm: float | None = None
    density_warmup_steps: int = 0
    density_warmup_start: float = 0.25
    exchange: str = AUTO
    scaler: Any = None
    adam: str = "frozen-variance"
    local_steps: tuple[int, int] | None = None
    warmup_compressor: str | Compressor | None = None
    variance_refresh: tuple[tuple[int, int], ...] = ()
    residual_decay: float | None = None
    server_feedback: bool = False
    padding_target: float | None = None
    log_every: int = 0
    jsonl_path: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        check_choice(self.granularity, "granularity", GRANULARITIES)
        check_int(self.min_numel, "min_numel", low=0)
        if self.warmup_steps is not None:
            check_int(self.warmup_steps, "warmup_steps", low=0)
        object.__setattr__(self, "value_dtype", parse_value_dtype(self.value_dtype))
        check_choice(self.nonfinite, "nonfinite", NONFINITE_POLICIES)
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise InvalidOptionError(
                f"error_feedback must be None, True or False, got {self.error_feedback!r}"
            )
        check_real(self.momentum, "momentum", low=0.0, high=1.0, high_open=True)
        check_bool(self.momentum_masking, "momentum_masking")
        if self.clip_norm is not None:
            check_real(self.clip_norm, "clip_norm", low=0.0, low_open=True)
        check_int(self.density_warmup_steps, "density_warmup_steps", low=0)
        check_ratio(self.density_warmup_start, "density_warmup_start")
        check_choice(self.exchange, "exchange", (AUTO, *available_exchanges()))
        check_choice(self.adam, "adam", ADAM_METHODS)
        if self.local_steps is not None:
            if self.adam != "zero-one":
                raise InvalidOptionError(
                    f"local_steps= sets 0/1 Adam's synchronisation intervals: it needs adam='zero-one' "
                    f"(this hook has adam={self.adam!r})"
                )
            object.__setattr__(self, "local_steps", parse_local_steps(self.local_steps))
        if self.warmup_compressor is not None and not isinstance(self.warmup_compressor, (str, Compressor)):
            raise InvalidOptionError(
                f"warmup_compressor must be a registry name or a Compressor, got {self.warmup_compressor!r}"
            )
        object.__setattr__(self, "variance_refresh", parse_windows(self.variance_refresh))
        if self.residual_decay is not None:
            check_real(self.residual_decay, "residual_decay", low=0.0, high=1.0)
        check_bool(self.server_feedback, "server_feedback")
        if self.padding_target is not None:
            check_real(self.padding_target, "padding_target", low=1.0)
        if self.scaler is not None and not hasattr(self.scaler, "is_enabled"):
            raise InvalidOptionError(
                f"scaler must be a torch.amp.GradScaler (or None), got {type(self.scaler).__name__}"
            )
        check_int(self.log_every, "log_every", low=0)
        if self.jsonl_path is not None and not isinstance(self.jsonl_path, (str, os.PathLike)):
            raise InvalidOptionError(f"jsonl_path must be a path or None, got {self.jsonl_path!r}")

    def with_frozen_variance_warmup(self) -> HookOptions:
        """These options under a frozen-variance Adam method, whose second moment needs dense
        steps: ``warmup_steps=0`` is refused; unset, it stays unset (the method ends its warm-up
        when the second moment has settled, :mod:`gradsift.hook.adam_warmup`)."""
        if self.warmup_steps == 0:
            raise InvalidOptionError(
                f"warmup_steps=0 with adam={self.adam!r}: the method freezes Adam's second moment after "
                "dense steps, and with none there is no second moment to freeze; pass warmup_steps >= 1, "
                "or leave it unset to end the warm-up when the second moment has settled"
            )
        return self

    def runs_frozen_variance(self, compressor: Compressor, feedback: bool, adam: bool) -> bool:
        """Whether a hook of these options, ``compressor`` and error feedback (``feedback``) runs a
        frozen-variance method when it takes an optimizer over (``adam``: one of the Adam family),
        whose warm-up then needs dense steps (:meth:`with_frozen_variance_warmup`; PowerSGD leaves
        Adam its moments)."""
        return adam and feedback and self.adam in FROZEN_METHODS and compressor.momentum_correction

    def feedback_decay(self, compressor: Compressor) -> float:
        """Error feedback's ``beta``: ``residual_decay``, or ``compressor``'s own when unset."""
        return compressor.residual_decay if self.residual_decay is None else self.residual_decay

    @property
    def dense_steps(self) -> int:
        """The dense warm-up's length: ``warmup_steps``, 0 when unset (under a frozen Adam method
        the method's own measured end applies instead: :mod:`gradsift.hook.adam_warmup`)."""
        return self.warmup_steps or 0


#: Keyword arguments of ``register_comm_hook`` that configure the hook (the rest go to the compressor).
HOOK_OPTIONS = ("process_group", "optimizer", *(f.name for f in dataclasses.fields(HookOptions)))


def resolve_compressor(compressor: str | Compressor, options: dict[str, Any]) -> Compressor:
    """``compressor`` built from its registry name and ``options`` (the non-hook keywords), or
    the instance as given (then ``options`` must be empty)."""
    if isinstance(compressor, str):
        check_keywords(compressor, options)
        return get_compressor(compressor, **options)
    if options:
        raise InvalidOptionError(
            f"options {sorted(options)} are not hook options and compressor is already built; "
            f"hook options are: {', '.join(HOOK_OPTIONS)}"
        )
    return compressor


def check_keywords(
    compressor: str | Compressor,
    options: dict[str, Any],
    refused: tuple[str, ...] = (),
    where: str = "",
    own: tuple[str, tuple[str, ...]] | None = None,
) -> None:
    """A frontend's keywords, checked: one of ``refused`` (hook options with no meaning there) is
    refused with ``f"{name}= is not supported {where}"``; with a registry name, one that is
    neither a hook option nor the compressor's is refused naming every name it could have meant
    -- the frontend's ``own`` keywords (``(frontend, names)``), the hook's options less those
    ``refused``, the compressor's -- and the closest of them
    (:func:`gradsift.core.spelling.closest`). A built compressor takes none:
    :func:`resolve_compressor` refuses them."""
    for name in refused:
        if options.get(name) is not None:
            raise InvalidOptionError(f"{name}= is not supported {where}")
    if not isinstance(compressor, str):
        return
    unknown = unknown_options(compressor, [name for name in options if name not in HOOK_OPTIONS])
    if not unknown:
        return
    frontend, own_names = own or ("", ())
    hook = tuple(name for name in HOOK_OPTIONS if name not in refused)
    its = compressor_options(compressor)
    hints = [match for name in unknown if (match := closest(name, (*own_names, *hook, *its)))]
    lists = [f"{frontend}'s own options are {', '.join(own_names)}"] if own_names else []
    lists += [
        f"the hook's options are {', '.join(hook)}",
        f"compressor {compressor!r} takes {', '.join(its) or 'none'}",
    ]
    raise InvalidOptionError(
        f"unknown option(s) {', '.join(unknown)}{did_you_mean(hints)}: {'; '.join(lists)}"
    )
