"""One process-wide optimizer step pre-hook for every hook object that must act before a step.

PyTorch's global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) sees every optimizer's step,
on the training thread, after backward returned -- or, for a step given a closure (LBFGS,
Lightning's automatic optimization), before the closure's backward runs inside the step
(:attr:`_Registry.closure` says which while the members are called). Three kinds of objects
use it: a hook state settling its closed step
(:meth:`gradsift.hook.state.GradsiftHookState.settle`), the first optimizer step's checks
(:mod:`gradsift.hook.first_step`) and a takeover's (:mod:`gradsift.hook.taken_over`). Each has
a ``before_step(optimizer)`` method and is called in the order it was added.

The global hook is registered once and never removed: an optimizer's step iterates over
PyTorch's global hooks, and removing one while another thread's optimizer steps
(``gradsift.tools.simulate`` runs its workers as threads) raised "OrderedDict mutated
during iteration". Objects come and go in a list under a lock instead; each is held
weakly, so a dropped one leaves nothing behind. With none, the hook returns at once.

The hooked model's next forward settles too (:func:`settles_before_forward`): a
``GradScaler`` that skipped the optimizer's step, a loop that steps no torch optimizer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class Settles(Protocol):
    """What has a closed step to settle."""

    def settle(self) -> None: ...


def settles_before_forward(state: Settles) -> Callable[[torch.nn.Module, Any], None]:
    """A forward pre-hook that settles ``state``'s closed step while ``state`` lives (held weakly)."""
    held = weakref.ref(state)

    def settle(module: torch.nn.Module, args: Any) -> None:
        alive = held()
        if alive is not None:
            alive.settle()

    return settle


class BeforeStep(Protocol):
    """What acts before an optimizer's step."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None: ...


class _Registry:
    """The objects behind the one global optimizer pre-hook (module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.members: list[weakref.ref[BeforeStep]] = []
        self.registered = False
        self._stepping = threading.local()  # per thread: the simulator's ranks step at once

    def add(self, member: BeforeStep) -> None:
        """Call ``member.before_step`` before every optimizer step (once, however often added)."""
        with self.lock:
            if any(ref() is member for ref in self.members):
                return
            self.members.append(weakref.ref(member))
            if not self.registered:
                register_optimizer_step_pre_hook(self.before_step)
                self.registered = True

    def remove(self, member: BeforeStep) -> None:
        with self.lock:
            self.members = [ref for ref in self.members if ref() not in (None, member)]

    @property
    def closure(self) -> bool:
        """Whether the step whose members this thread is calling was given a closure."""
        return bool(getattr(self._stepping, "closure", False))

    def holds(self, member: BeforeStep) -> bool:
        with self.lock:
            return any(ref() is member for ref in self.members)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self.lock:
            alive = [member for ref in self.members if (member := ref()) is not None]
        # PyTorch passes the step's own arguments, the optimizer first: ``step(closure)``
        self._stepping.closure = (args[1] if len(args) > 1 else kwargs.get("closure")) is not None
        for member in alive:
            member.before_step(optimizer)


BEFORE_STEP = _Registry()
