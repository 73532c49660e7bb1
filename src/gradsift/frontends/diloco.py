"""Low-communication training: DiLoCo's outer steps on compressed pseudo-gradients.

``state = gradsift.diloco(model, optimizer, sync_every=H, compressor="sidco-exp", ratio=0.01)``
for a model that is *not* wrapped in DDP (Douillard et al. 2023; SparseLoCo 2025). Each
worker trains on its own data with its own (inner) optimizer and no communication; a
step post-hook on that optimizer counts the inner steps (an optimizer built again mid-run
is counted once the script drops the old one), and after every ``H`` of them the round ends:

1. the pseudo-gradient of every trainable parameter, ``Delta_k = theta - theta_k`` (the
   shared parameters of the round's start minus this worker's), is flattened into one
   buffer and goes through gradsift's DDP-hook pipeline as one bucket: error feedback
   ``c = Delta_k + beta r`` (``residual_decay`` ``beta``; the residual stays local), the
   compressor, the exchange (any one the compressor supports), the step's checks read once,
   the ``nonfinite`` policy -- so every compressor of the registry works here, with the
   hook's telemetry, transactions and checkpoints, but VGC, whose test reads the variance
   that backward records for a gradient (:func:`check_round_compressor`);
2. the outer optimizer -- SGD with Nesterov momentum, ``outer_lr`` (``eta``) and
   ``outer_momentum`` (``mu``; DiLoCo's settings are 0.7 and 0.9, the defaults here 1 and
   0, SparseLoCo's) -- steps the shared parameters with the mean ``Delta`` as their gradient:
   ``u <- mu u + Delta``, ``theta <- theta - eta (Delta + mu u)``;
3. the model is set to the shared parameters, and its buffers (BatchNorm's running
   statistics) to their mean over the workers (``buffers="mean"``; ``"local"`` keeps each
   worker's).

SparseLoCo's variant is ``outer_momentum=0`` with ``residual_decay < 1``: error feedback
with decay takes the momentum's place. A round whose pseudo-gradient is non-finite on
some worker follows ``nonfinite`` (default ``"skip"`` here: the outer step is not taken
and every worker restarts from the round's shared parameters; ``"raise"``:
:class:`NonFiniteGradientError`; ``"propagate"``: the NaN reaches the parameters, as
stock training would). A worker that dies makes the others raise
:class:`PeerFailureError` within the process group's timeout.

``diloco`` starts every worker from rank 0's parameters and buffers (one broadcast).
Parameters without ``requires_grad`` are neither exchanged nor changed. ``state.stats()``
reports like the hook's, per round, with ``dense_bytes`` what DDP would have sent over
the same inner steps (``H`` allreduces of the trainable parameters in their dtype);
``state.state_dict()`` / ``load_state_dict()`` hold the hook's state, the outer optimizer's,
the shared parameters and the inner-step count, so a run resumes bit for bit (with the
inner optimizer's and the model's own state dicts).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors.base import Compressor
from gradsift.compressors.registry import compressor_class
from gradsift.core.agreement import tensors_text
from gradsift.core.collectives import blocking, broadcast_from_first
from gradsift.core.errors import InvalidOptionError
from gradsift.core.validation import check_bool, check_choice, check_int, check_real
from gradsift.hook.before_step import BEFORE_STEP
from gradsift.hook.checkpoint_checks import check_hook_entry
from gradsift.hook.feedback import RESIDUAL
from gradsift.hook.handshake import check_hook_settings
from gradsift.hook.layout import FlatBucket
from gradsift.hook.param_groups import model_groups
from gradsift.hook.recipe import unwrapped
from gradsift.hook.route import route_bucket
from gradsift.hook.state import GradsiftHookState

#: Error feedback's decay by default: SparseLoCo's ``beta`` in ``c = Delta + beta r``.
SPARSELOCO_DECAY = 0.95

BUFFER_POLICIES = ("mean", "local")
#: Where what a worker did not send waits: error feedback's residual, or its own parameters.
UNSENT_POLICIES = ("residual", "model")
#: The keywords of :func:`diloco` that are its own (the others go to the hook and the compressor).
OUTER_OPTIONS = ("outer_lr", "outer_momentum", "nesterov", "buffers", "unsent")
#: Every keyword :func:`diloco` takes itself: what an unknown one may have meant besides the hook's.
DILOCO_KEYWORDS = ("sync_every", "compressor", *OUTER_OPTIONS)
#: Hook options with no meaning for pseudo-gradients (no optimizer, loss scale or warm-up; one part).
_REFUSED = ("optimizer", "granularity", "warmup_steps", "scaler")


class DiLoCoState:
    """What :func:`diloco` keeps (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        hook: GradsiftHookState,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        buffers: str,
        unsent: str = "residual",
    ) -> None:
        self.model = model
        self.unsent = unsent
        self.hook = hook
        self.sync_every = sync_every
        self.buffers = buffers
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidOptionError("the model has no trainable parameter to train with DiLoCo")
        self.shared = [p.detach().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.shared, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )
        self.inner_steps = 0
        self.rounds = 0
        self._ids = {id(p) for p in self.params}
        self._follow(optimizer)
        BEFORE_STEP.add(self)

    def _follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps as the inner steps (held weakly: one the script drops is gone)."""
        self._inner = weakref.ref(optimizer)
        self._handle = optimizer.register_step_post_hook(self._after_inner_step)
        self._others = 0  # steps of another optimizer of these parameters since this one's last

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before any optimizer's step: an optimizer built again mid-run (the one counted dropped
        by the script, another stepping these parameters) is counted from its first step, so
        the rounds go on; while the one counted lives, another stepping these parameters
        :attr:`sync_every` times in a row without it is refused (the rounds would stop, and the
        workers would train apart without a word)."""
        inner = self._inner()
        if inner is not None and unwrapped(inner) is unwrapped(optimizer):
            self._others = 0
            return
        if not any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"]):
            return
        if inner is None:
            self._follow(optimizer)
            return
        self._others += 1
        if self._others >= self.sync_every:
            raise InvalidOptionError(
                f"DiLoCo counts the inner steps of the optimizer it was given ({type(inner).__name__}), "
                f"which has not stepped for {self._others} steps of another ({type(optimizer).__name__}) "
                "on the same parameters: no round would end; drop every reference to the old optimizer "
                "(DiLoCo then counts the new one), or build the state with the optimizer that steps"
            )

    # -- the round --------------------------------------------------------------------------
    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """End the round now: exchange the pseudo-gradients, take the outer step, reset the model."""
        with torch.no_grad():
            sizes = [p.numel() for p in self.params]
            dtype = functools.reduce(torch.promote_types, (s.dtype for s in self.shared))  # torch.cat's
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.shared[0].device)
            for shared, param, piece in zip(self.shared, self.params, flat.split(sizes), strict=True):
                torch.sub(shared.reshape(-1), param.detach().reshape(-1), out=piece)  # no copy per parameter
            future = route_bucket(self.hook, FlatBucket(flat, self.params, last=True))
            mean = future.value()
            if not self.hook.last_step_skipped:
                for shared, piece in zip(self.shared, mean.split(sizes), strict=True):
                    shared.grad = piece.view_as(shared)  # the outer step reads it; dropped right after
                self.outer_optimizer.step()
                self.outer_optimizer.zero_grad(set_to_none=True)
            kept = self._take_unsent() if self.unsent == "model" else [None] * len(self.params)
            for param, shared, unsent in zip(self.params, self.shared, kept, strict=True):
                param.copy_(shared if unsent is None else shared - unsent.view_as(shared).to(shared.dtype))
            if self.buffers == "mean":
                _average_buffers(self.model, self.hook.process_group)
        self.rounds += 1

    def _take_unsent(self) -> list[torch.Tensor | None]:
        """``unsent="model"``: the residual of the round (what this worker did not send), per
        parameter, taken out of error feedback: the worker keeps it in its own parameters."""
        key = tuple(sorted(self.hook.layout.numbers[id(p)] for p in self.params))
        residual = self.hook.store.get(RESIDUAL, key)
        if residual is None:
            return [None] * len(self.params)
        self.hook.store.discard(key, (RESIDUAL,))
        return list(residual.split([p.numel() for p in self.params]))

    def detach(self) -> None:
        """Stop counting the inner optimizer's steps."""
        self._handle.remove()
        BEFORE_STEP.remove(self)

    # -- read-outs and checkpoints ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The hook's ``stats()`` per round, ``dense_bytes`` what DDP would have sent over the
        round's ``sync_every`` inner steps."""
        stats = self.hook.stats()
        for part in ("step", "total"):
            if "dense_bytes" in stats[part]:
                stats[part]["dense_bytes"] *= self.sync_every
        stats["total"]["inner_steps"] = self.inner_steps
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The hook's state, the outer optimizer's, the shared parameters and the step counts."""
        return {
            "hook": self.hook.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "shared": [s.clone() for s in self.shared],
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model and the inner optimizer restore their own)."""
        missing = {"hook", "outer", "shared", "inner_steps", "rounds"} - set(state)
        if missing:
            raise InvalidOptionError(f"DiLoCo state needs keys {sorted(missing)}")
        if len(state["shared"]) != len(self.shared):
            raise InvalidOptionError(
                f"DiLoCo state holds {len(state['shared'])} shared parameters, this model has {len(self.shared)}"
            )
        for index, (shared, saved) in enumerate(zip(self.shared, state["shared"], strict=True)):
            if not isinstance(saved, torch.Tensor) or saved.shape != shared.shape:  # copy_ would broadcast
                got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise InvalidOptionError(
                    f"DiLoCo state's shared parameter {index} is {got}, this model's is {tuple(shared.shape)}: "
                    "a state saved for another model"
                )
        check_hook_entry(self.hook, state["hook"], None, "the DiLoCo state's hook")
        self.hook.load_state_dict(state["hook"])
        with torch.no_grad():
            for shared, saved in zip(self.shared, state["shared"], strict=True):
                shared.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer"])
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])


def round_compressor(name: str) -> type[Compressor]:
    """The registry's class for ``name``, which a round exchanges: ``"auto"`` is refused by name
    (it chooses among methods from DDP buckets' step times; a round has one pseudo-gradient)."""
    if name == "auto":
        raise InvalidOptionError(
            "compressor='auto' chooses the DDP hook's method from its buckets' step times; DiLoCo "
            "sends one pseudo-gradient per round: name the method (default 'blockquant'; SparseLoCo's "
            "'sidco-exp' at ratio=0.01)"
        )
    return compressor_class(name)


def check_round_compressor(method: Compressor | type[Compressor]) -> None:
    """Refuse a method that reads what backward records for each gradient
    (``needs_parameters``: VGC's variance): a round's pseudo-gradient is the parameters' change
    over ``H`` inner steps, the optimizer's updates, whose variance backward does not give, and
    what it recorded within a round is in no checkpoint."""
    if method.needs_parameters:
        raise InvalidOptionError(
            f"compressor {method.name!r} tests each value against the variance that backward records for "
            "its gradient; DiLoCo's pseudo-gradient is the parameters' change over the round's inner "
            "steps, whose variance backward does not give: pick a method that reads only the values "
            "(e.g. 'blockquant', 'sidco-exp', 'topk')"
        )


def _average_buffers(model: torch.nn.Module, group: Any) -> None:
    """Every floating-point buffer set to its mean over the group (one allreduce each)."""
    world = dist.get_world_size(group)
    for buffer in model.buffers():
        if buffer.is_floating_point():
            blocking("buffer allreduce", group, _collective(dist.all_reduce, buffer, group=group))
            buffer.div_(world)


def _collective(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A started collective ``function(*args, **kwargs, async_op=True)``, for :func:`blocking`."""
    return lambda: function(*args, **kwargs, async_op=True)


def diloco(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sync_every: int = 10,
    compressor: str | Compressor = "blockquant",
    *,
    outer_lr: float = 1.0,
    outer_momentum: float = 0.0,
    nesterov: bool = True,
    buffers: str = "mean",
    unsent: str = "residual",
    **options: Any,
) -> DiLoCoState:
    """Train ``model`` (not DDP-wrapped) with DiLoCo's outer steps every ``sync_every`` inner
    steps of ``optimizer`` (see the module docstring); returns the state.

    ``options`` are the compressor's (``ratio``, ...) and the DDP hook's (``exchange``,
    ``value_dtype``, ``nonfinite``, ``residual_decay``, ``process_group``, ``log_every``, ...;
    not ``optimizer``, ``granularity`` or ``warmup_steps``, which have no meaning for
    pseudo-gradients).

    The defaults are quantized periodic averaging, the AdamW campaign's best mode among those
    sending a small fraction of DDP's bytes (docs/adam.md, docs/decisions.md): every 10 inner
    steps, the pseudo-gradient in ``blockquant``'s 4-bit codes (one absmax scale per 64
    elements: ``4 + 32 / 64 = 4.5`` bits per element per round, where DDP sends ``32 x 10``),
    error feedback with ``residual_decay=0.95`` in place of outer momentum, ``outer_lr=1`` (the
    mean pseudo-gradient applied as it is).
    SparseLoCo's form is ``compressor="sidco-exp"`` (ratio 0.01); DiLoCo's own
    outer step is ``outer_lr=0.7, outer_momentum=0.9`` (Nesterov).

    ``unsent="model"`` (with error feedback at ``residual_decay=1.0``) keeps what a worker
    did not send in its own parameters, as CocktailSGD does: after the outer step the
    worker restarts from ``theta - u`` (``u`` its round's residual, which is then cleared)
    instead of the shared ``theta``, so its next gradients are taken where its own updates
    left it; the default ``"residual"`` restarts every worker from ``theta`` and keeps ``u``
    aside for the next round's pseudo-gradient. A skipped (non-finite) round restarts from
    ``theta`` either way.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidOptionError(
            "diloco takes the model itself, not a DistributedDataParallel wrapper: DiLoCo's workers "
            "do not synchronise their gradients"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidOptionError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_int(sync_every, "sync_every", low=1)
    check_real(outer_lr, "outer_lr", low=0.0, low_open=True)
    check_real(outer_momentum, "outer_momentum", low=0.0, high=1.0, high_open=True)
    check_choice(buffers, "buffers", BUFFER_POLICIES)
    check_choice(unsent, "unsent", UNSENT_POLICIES)
    check_bool(nesterov, "nesterov")
    if not dist.is_initialized():
        raise InvalidOptionError("diloco needs an initialised torch.distributed process group")
    options.setdefault("nonfinite", "skip")
    method = compressor if isinstance(compressor, Compressor) else round_compressor(compressor)
    check_round_compressor(method)
    feedback = options.get("error_feedback")
    if feedback is None:
        feedback = method.error_feedback
    if feedback:
        options.setdefault("residual_decay", SPARSELOCO_DECAY)
    hook = GradsiftHookState.resolve(
        compressor,
        options,
        _REFUSED,
        "by diloco (it applies to the DDP hook's gradients)",
        ("diloco", DILOCO_KEYWORDS),
    )
    if unsent == "model" and (hook.feedback is None or hook.feedback.decay != 1.0):
        raise InvalidOptionError(
            "unsent='model' keeps what was not sent in the worker's parameters, which takes a "
            "compressor with error feedback and residual_decay=1.0"
        )
    hook.layout.bind(model)
    if next(model_groups(unwrapped(optimizer), hook.layout.numbers), None) is None:
        raise InvalidOptionError(
            f"optimizer ({type(optimizer).__name__}) holds none of the model's parameters: its inner "
            "steps would leave the model as it is; pass the optimizer that steps model.parameters()"
        )
    hook.compressor.attach(model)
    outer = {"sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
             "nesterov": nesterov, "buffers": buffers, "unsent": unsent,
             "parameters and buffers": tensors_text([*model.parameters(), *model.buffers()])}  # fmt: skip
    check_hook_settings(hook, "diloco", outer)  # collective: ranks that disagree stop here
    broadcast_from_first([*model.parameters(), *model.buffers()], hook.process_group)  # rank 0's start
    return DiLoCoState(
        model, optimizer, hook, sync_every, outer_lr, outer_momentum, nesterov, buffers, unsent
    )
