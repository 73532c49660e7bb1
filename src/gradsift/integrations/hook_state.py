"""The hook a trainer's callback registers once the trainer has wrapped the model in DDP.

Lightning and Hugging Face's ``Trainer`` create the ``DistributedDataParallel`` wrapper
themselves, after the user has configured the callbacks. Their gradsift callbacks hold a
:class:`PendingHook` from the arguments :func:`gradsift.register_comm_hook` takes and
register it with :func:`gradsift.frontends.ddp.register_comm_hook` once the trainer has
wrapped the model. A named method's :class:`~gradsift.hook.state.GradsiftHookState` is built
up front, so a wrong option fails when the callback is made, not minutes later; the
state of ``compressor="auto"`` (:class:`~gradsift.hook.auto.AutoHookState`) is built from
the DDP model, so it -- and the check of its options -- waits for the registration.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.frontends.ddp import register_comm_hook
from gradsift.hook import recipe
from gradsift.hook.auto import AUTO, AutoHookState
from gradsift.hook.choice import auto_options
from gradsift.hook.state import GradsiftHookState


class PendingHook:
    """A hook to register on a DDP model that does not exist yet (module docstring).

    Args:
        compressor: ``"auto"``, a registry name or a built
            :class:`~gradsift.compressors.base.Compressor`, as for :func:`gradsift.register_comm_hook`.
        options: hook options (:data:`gradsift.hook.options.HOOK_OPTIONS`: ``granularity``,
            ``warmup_steps``, ...) and, when ``compressor`` is a registry name, the compressor's
            options (``ratio``, ...).

    Attributes:
        named: a named method's state, built here; None under ``"auto"``.
    """

    def __init__(self, compressor: str | Compressor, options: dict[str, Any]) -> None:
        if "optimizer" in options:
            raise InvalidOptionError(
                "a trainer callback hands the hook the trainer's optimizer itself: pass take_optimizer=True "
                "(the default) or False (none, and none looked for), not optimizer="
            )
        is_auto = isinstance(compressor, str) and compressor == AUTO
        if is_auto:
            auto_options(options)  # a misspelt name, or a method's own, is refused now, not at fit
        self.named = None if is_auto else GradsiftHookState.build(compressor, **options)
        self._auto_options = dict(options)  # what "auto" is registered with
        self._state: GradsiftHookState | AutoHookState | None = self.named

    @property
    def state(self) -> GradsiftHookState | AutoHookState:
        """The hook's state: a named method's from the start, ``"auto"``'s once registered."""
        if self._state is None:
            raise InvalidOptionError(
                "compressor='auto' builds its hook state from the DDP model, so it exists once the trainer "
                "has wrapped the model and the callback registered the hook (on_train_begin / on_fit_start), "
                "in the process that trains (under a spawning strategy, such as Lightning's ddp_spawn, that is "
                "another process: read it there, e.g. in on_train_end, or from the trainer's loggers); name a "
                "method (e.g. 'sidco-exp') for a state to hand the trainer before that"
            )
        return self._state

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse, in a callback's words, a trainer's optimizer whose momentum the named method
        would take over and cannot (:func:`gradsift.hook.recipe.can_hold`: Adafactor, LAMB, Lion
        ...); ``register_comm_hook`` would name its own ``optimizer=False``."""
        named = self.named
        if named is None or named.feedback is None or not named.compressor.momentum_correction:
            return  # auto picks a method the optimizer allows; without error feedback nothing is taken
        if optimizer not in (None, False) and not recipe.can_hold(optimizer):
            raise InvalidOptionError(
                f"the trainer's optimizer is {type(recipe.unwrapped(optimizer)).__name__}, whose momentum "
                f"{named.compressor.name!r} cannot take over (it takes {recipe.SUPPORTED_OPTIMIZERS}): pass "
                "take_optimizer=False for error feedback without momentum correction, or leave the compressor "
                "to 'auto'"
            )

    def register(
        self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any, **auto_defaults: Any
    ) -> GradsiftHookState | AutoHookState:
        """Install the hook on ``ddp_model`` with ``optimizer`` (``False``: none, and none looked
        for) and return its state. ``auto_defaults`` are options of ``"auto"`` the caller knows
        (``steps``, the run's length); the options given to the constructor win over them."""
        if self.named is not None:
            self.check_optimizer(optimizer)
            return register_comm_hook(ddp_model, self.named, optimizer=optimizer)
        self._state = register_comm_hook(
            ddp_model, AUTO, optimizer=optimizer, **{**auto_defaults, **self._auto_options}
        )
        return self._state
