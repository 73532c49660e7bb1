"""An optimizer built again while ``auto`` runs: followed, not left.

Fine-tuning scripts build their optimizer again between phases (the head first, then the whole
model; a new learning rate). ``auto`` found the first one at its first bucket
(:mod:`gradsift.hook.discovery`); :class:`OptimizerFollower` sees every optimizer step (the
process-wide step pre-hook, :mod:`gradsift.hook.before_step`) and tells, at the next step's
first bucket, what stepped the hooked parameters since the last one:

* another optimizer, and not the one followed: it was **built again**, and is followed from then
  on (:meth:`OptimizerFollower.outcome` returns it). ``auto`` adopts it as if found, gives the
  momentum of a method with a takeover back to the old one, and enters that method again on the
  new one -- at once for momentum correction under SGD (the new SGD's momentum buffers start
  its velocity), after Adam's dense warm-up for the 1-bit Adam method (its frozen second moment
  must be the new optimizer's);
* another optimizer beside the one followed: **a second optimizer** for some of them, which no
  takeover can follow (:data:`SECOND`): ``auto`` runs stock DDP from then on, as for what
  :mod:`gradsift.hook.taken_over` finds.

Only an optimizer ``auto`` found is followed: one passed as ``optimizer=`` is the script's word,
and another stepping its parameters is found by the takeover's checks as before.
"""

from __future__ import annotations

import weakref

import torch

from gradsift.hook.before_step import BEFORE_STEP
from gradsift.hook.param_groups import model_groups
from gradsift.hook.recipe import unwrapped

SECOND = (
    "a second optimizer steps some of the model's parameters beside the one auto found: no method "
    "with a takeover can follow two (the momentum it holds is one optimizer's)"
)


class OptimizerFollower:
    """Follows ``optimizer`` (found by ``auto``) through the script's rebuilds (module docstring);
    ``numbers``: ``id(parameter) -> number`` of the hooked parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> None:
        self.optimizer = unwrapped(optimizer)
        self.numbers = numbers
        self._foreign: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # hold none of them
        self._other: weakref.ref[torch.optim.Optimizer] | None = None  # stepped them since the last outcome
        self._stepped = False  # the followed one stepped since the last outcome
        BEFORE_STEP.add(self)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        inner = unwrapped(optimizer)
        if inner is self.optimizer:
            self._stepped = True
        elif inner not in self._foreign:  # an optimizer's groups are walked once, or at each of its steps
            if next(model_groups(inner, self.numbers), None) is None:
                self._foreign.add(inner)
            else:
                self._other = weakref.ref(inner)

    def outcome(self) -> torch.optim.Optimizer | str | None:
        """At a step's first bucket, what stepped the hooked parameters since the last call: the
        optimizer that replaced the one followed (followed from now on), :data:`SECOND` when
        another stepped them beside it, else None."""
        other = None if self._other is None else self._other()
        stepped, self._other, self._stepped = self._stepped, None, False
        if other is None:
            return None
        if stepped:
            return SECOND
        self.optimizer = other
        return other

    def detach(self) -> None:
        """Stop following (``auto`` runs stock DDP for good)."""
        BEFORE_STEP.remove(self)
