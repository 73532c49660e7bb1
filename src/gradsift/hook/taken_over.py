"""What the hook checks at every step of an optimizer whose momentum it took over.

Momentum correction (:mod:`gradsift.hook.recipe`) and the Adam methods (:mod:`gradsift.hook.adam`)
move the optimizer's momentum into the hook: a velocity ``u <- m u + g`` advanced at every
exchange, with one ``m`` (SGD's ``momentum``, Adam's ``beta1``) fixed at the takeover. Five things
a training script may do break that without an error of their own; :class:`TakenOverChecks`
raises :class:`~gradsift.core.errors.InvalidOptionError` for each at that optimizer's step,
before it steps (under ``auto``: warns, and ``auto`` runs stock DDP from the next step), on every
rank alike (the ranks' steps, exchanges and optimizer settings are the
same; a rank that joined under DDP's ``join()`` steps no optimizer, so it is never checked):

* **More than one kept exchange since the optimizer last stepped** (the ledger's ``kept_since``:
  a dropped step, which a ``GradScaler`` skips, is none). Stock DDP's gradient accumulation --
  several backward passes, each allreducing, then one optimizer step -- is exact by linearity
  (``mean(a) + mean(b) = mean(a + b)``); under the hook each pass is a step of the velocity, so
  momentum would be applied once per pass, and a pass whose gradients the optimizer never steps
  (a GAN's discriminator during the generator's pass) would still move it.
* **The momentum changed after the takeover**: an SGD group holding the model's parameters
  whose ``momentum`` is no longer the 0 the hook left there, or an Adam group whose ``beta1`` is
  no longer the one the hook runs (a scheduler cycling momentum, as ``OneCycleLR`` and
  ``CyclicLR`` do by default): the optimizer would apply momentum on top of the hook's, or the
  hook would go on with a ``beta1`` the script no longer asks for.
* **Another optimizer stepping the model's parameters** (one built again mid-run, or a second
  one for some of them): the hook's exchange carries the momentum it took from the first, so
  the other would step a velocity, and apply its own momentum on top.
* **The groups replaced after the takeover**: an SGD group with its momentum back and without
  the hook's record, as ``optimizer.load_state_dict`` of a checkpoint saved without gradsift
  leaves it (loaded before the takeover, its buffers become the velocity instead).
* **Under the Adam methods, a parameter without a second moment at a compressed step** (frozen
  through the dense warm-up and unfrozen since): the frozen preconditioner has nothing to freeze.
  Found by the optimizer's step (:mod:`gradsift.hook.adam`), which under ``auto`` takes it as a
  tensor the warm-up never moved.

Three it follows instead, at each step's first bucket, before the step's exchange
(:meth:`TakenOverChecks.follow_groups`), so the run keeps the optimizer's arrangement:

* **A parameter group added** (``optimizer.add_param_group``, as fine-tuning scripts unfreeze a
  body the optimizer left out). SGD's is taken over as the first groups were
  (:func:`~gradsift.hook.recipe.take_over_added`: a momentum other than the hook's, Nesterov or
  dampening found as above), and the hook's state of its parameters -- velocity, residual,
  every per-element table of the store -- is zeroed: SGD starts their momentum buffers empty and
  never stepped the gradients exchanged before, so with nothing dropped the run is stock DDP's
  with the same ``add_param_group``. Under the Adam methods a group added during the dense
  warm-up gets its moments from Adam's own steps; one added after the warm-up lacks the second
  moments the compressed steps use, and is found. A group added between a step's backward and
  its optimizer step (after the exchange) is found too; before a step given a closure, it is
  followed at the closure's backward.
* **A ``weight_decay`` set again after the takeover** (a schedule): SGD's moves into the hook as
  the takeover moved it, Adam's L2 decay is copied again.
* **Parameters no group holds** (a head-only optimizer while the body still trains in DDP, a
  fine-tuning script's first stage): their error-feedback state (velocity, residual) is kept at
  zero, since nothing steps what it would carry -- their gradients, not zeroed by that optimizer,
  would grow step by step and that state with them, and a group added for them, or the optimizer
  built again, would step it all at once.

And one it warns about, at the first such step: **an optimizer restored without the hook's
state.** While the hook holds the velocity (always under SGD's momentum correction; past the
dense warm-up under the Adam methods), every step records the hook's step count ``n`` in the
optimizer's parameter groups (:data:`HOOK_STEP_KEY`), so an optimizer checkpoint carries it.
A hook whose count at its first step is still ``<= n`` did not load the state saved with that
optimizer (or loaded an older one): its velocity and residuals start from zero, and the run
departs from the one saved. Leaving the method (``auto`` giving the momentum back) removes the
record.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from gradsift.core.errors import InvalidOptionError
from gradsift.hook.adam import check_adam, l2_decay
from gradsift.hook.before_step import BEFORE_STEP
from gradsift.hook.param_groups import model_groups
from gradsift.hook.recipe import (
    CYCLED_MOMENTUM,
    MOMENTUM_KEY,
    WEIGHT_DECAY_KEY,
    momentum_name,
    take_over_added,
    unwrapped,
)

#: The parameter-group entry holding the hook's step count at the optimizer's last step.
HOOK_STEP_KEY = "gradsift_hook_step"

ACCUMULATION = (
    "Accumulate gradients under ddp_model.no_sync() for all but the last micro-batch (its one exchange "
    "carries their sum), and run a backward whose gradients this optimizer does not step (a GAN's "
    "discriminator in the generator's pass) under no_sync() too; or register the hook with optimizer=False"
)


class TakenOverChecks:
    """The checks of the module docstring for one hook ``state`` (a
    :class:`~gradsift.hook.state.GradsiftHookState` whose optimizer's momentum it took over)."""

    def __init__(self, state: Any) -> None:
        self.state = weakref.ref(state)  # the state holds these checks: no cycle keeps either alive
        self.numbers = {id(p): i for i, p in enumerate(state.hooked)}  # alive while the state is
        self.first = True
        #: Refuse what the checks find (a named method); False under ``auto``, which records it in
        #: :attr:`found` and leaves the method (:func:`gradsift.hook.handover.found_unfollowable`).
        self.refuse = True
        self.found: str | None = None
        #: Another optimizer stepping the model is ``auto``'s to tell apart (built again, or a
        #: second one: :mod:`gradsift.hook.rebuilt`), not a finding here.
        self.followed = False
        #: Adam's group decays as last copied (:meth:`follow_groups`); None: not yet.
        self.decays: list[float] | None = None
        #: The optimizer's groups when last followed: those past it were added since.
        self.group_count = len(unwrapped(state.optimizer).param_groups)
        self.orphans = self._orphans(state.hooked, unwrapped(state.optimizer))
        if state.adam is not None:  # a parameter without a second moment at a compressed step
            state.adam.found = self._found
        BEFORE_STEP.add(self)  # after the state, which settles its closed step first

    def _found(self, problem: str) -> None:
        """Refuse ``problem`` (a named method); under ``auto`` (:attr:`refuse` False) warn once and
        record it in :attr:`found`: ``auto`` then runs stock DDP from the next step, as the script
        would train without the hook."""
        if self.refuse:
            raise InvalidOptionError(problem)
        if not self.found:
            warnings.warn(f"gradsift: {problem}; auto runs stock DDP's allreduce from here", stacklevel=5)
        self.found = problem

    def detach(self) -> None:
        """Stop checking and recording: the optimizer has its momentum back (``auto`` left the method)."""
        BEFORE_STEP.remove(self)
        state = self.state()
        if state is not None and state.optimizer is not None:
            for _, group, _ in model_groups(state.optimizer, self.numbers):
                group.pop(HOOK_STEP_KEY, None)

    def follow_groups(self) -> None:
        """At a step's first bucket, before its exchange: the groups added since the last step
        (:meth:`follow_added_groups`), then an SGD group whose ``weight_decay`` the script set
        again after the takeover left it 0 (a schedule) hands the new value to the hook, as the
        takeover did, so SGD does not add it on top of the hook's (a value set back to exactly 0
        cannot be told from the takeover's 0: the last one stays); under Adam (not AdamW, whose
        decoupled decay its step reads) the hook's copy of the L2 decay, which the groups keep,
        is taken again."""
        self.follow_added_groups()
        state = self.state()
        if state is None or state.optimizer is None:
            return
        if self.orphans:  # no group holds them: nothing steps what their state would carry
            state.store.zero_parameters(self.orphans, state.layout.numels)
        optimizer = unwrapped(state.optimizer)
        decays = [group.get("weight_decay", 0.0) for group in optimizer.param_groups]  # a few groups
        if state.adam is not None:  # Adam's L2 decay stays in its groups: the copy follows a change
            if decays != self.decays:
                self.decays, state.weight_decay = decays, l2_decay(optimizer, state.layout.numbers)
            return
        if any(decays):  # a taken SGD group holds 0: only a value set again walks the parameters
            for _, group, mine in model_groups(optimizer, state.layout.numbers):
                decay = float(group.get("weight_decay", 0.0))
                if decay:
                    group[WEIGHT_DECAY_KEY], group["weight_decay"] = decay, 0.0
                    state.weight_decay.update(dict.fromkeys(mine, decay))

    def follow_added_groups(self) -> None:
        """Take over the groups holding the model's parameters added since the last call, or
        find what cannot be followed (module docstring). The hook's state of a new group's
        parameters is zeroed first, so a method leaving for stock DDP under ``auto`` gives them
        no momentum buffer and no residual; a group carrying the hook's record (``MOMENTUM_KEY``,
        :data:`HOOK_STEP_KEY`: added, then an optimizer checkpoint of the run that took it over
        loaded) keeps the hook state loaded with it. ``auto`` calls it before its step start."""
        state = self.state()
        if state is None or state.optimizer is None:
            return
        optimizer = unwrapped(state.optimizer)
        start, self.group_count = self.group_count, len(optimizer.param_groups)
        if self.group_count == start:  # the common step: no walk over the parameters
            return
        self.orphans = self._orphans(state.hooked, optimizer)
        added = [
            (group, mine) for index, group, mine in model_groups(optimizer, self.numbers) if index >= start
        ]
        if not added:
            return
        new = [n for group, mine in added if not {MOMENTUM_KEY, HOOK_STEP_KEY} & set(group) for n in mine]
        state.store.zero_parameters(new, state.layout.numels)  # as the optimizer starts them
        problem = (
            "a parameter group added with optimizer.add_param_group after the hook took the momentum over"
        )
        try:
            if state.adam is None:
                state.weight_decay.update(take_over_added(optimizer, self.numbers, start))
                return
            check_adam(optimizer, self.numbers)
        except InvalidOptionError as error:
            self._found(f"{problem}: {error}")
            return
        if new and not state.warming():
            self._found(
                f"{problem}, after the Adam method's dense warm-up ended: its compressed steps use the "
                "second moments the warm-up gave (frozen; under adam='update' counted from its end), which "
                "the added parameters lack; add every group before the warm-up ends (a group not trained "
                "yet at lr=0), or leave the compressor to auto"
            )

    def _orphans(self, hooked: list[Any], optimizer: Any) -> list[int]:
        """The numbers of the hooked parameters that train (``requires_grad``: a frozen one has
        no state, and walking it every step would cost for nothing) and no group of
        ``optimizer`` holds."""
        held = {number for _, _, mine in model_groups(optimizer, self.numbers) for number in mine}
        return [number for number, param in enumerate(hooked) if param.requires_grad and number not in held]

    def before_step(self, optimizer: Any) -> None:
        state = self.state()
        indexed = list(model_groups(optimizer, self.numbers))
        if state is None or not indexed:
            return
        exchanges, state.ledger.kept_since = state.ledger.kept_since, 0
        if unwrapped(optimizer) is not unwrapped(state.optimizer):
            if self.followed:
                return
            self._found(
                f"an optimizer ({type(optimizer).__name__}) other than the one whose momentum the hook "
                "took over steps the model's parameters (an optimizer built again mid-run, or a second one "
                "for some of them): the hook's exchange carries the momentum it took, so that optimizer "
                "would step a velocity; keep the one optimizer and change its param_groups (learning rate, "
                "weight decay, add_param_group: the hook follows them), or register with optimizer=False"
            )
            return
        if exchanges > 1:
            self._found(
                f"{exchanges} exchanges of the hook's gradients before one step of the optimizer whose "
                "momentum it took over (one per backward pass): each advances the hook's velocity, so "
                f"momentum would be applied per pass. {ACCUMULATION}"
            )
            return
        beta1 = None if state.adam is None else state.adam.beta1
        added = len(unwrapped(optimizer).param_groups) > self.group_count
        if added and not BEFORE_STEP.closure and (beta1 is None or not state.warming()):
            self._found(
                "a parameter group was added with optimizer.add_param_group between backward and the "
                "optimizer's step, after the hook's exchange: the hook takes an added group over at the "
                "next step's first bucket; add it before the backward pass"
            )
            return
        # the groups followed so far: a closure's backward, inside this step, follows the others
        groups = [group for index, group, _ in indexed if index < self.group_count]
        changed = [group for group in groups if _momentum_of(group, beta1) != (beta1 or 0.0)]
        if changed and beta1 is None and MOMENTUM_KEY not in changed[0]:
            self._found(
                "the optimizer's parameter groups were replaced after the hook took its momentum over "
                f"(momentum {_momentum_of(changed[0], beta1)} again, without the hook's record: "
                "optimizer.load_state_dict of a checkpoint saved without gradsift), so momentum would be "
                "applied twice; load the optimizer before register_comm_hook(..., optimizer=...), or leave "
                "optimizer= out: the hook finds the optimizer at the first backward, after the load"
            )
            return
        if changed:
            self._found(
                f"the optimizer's {momentum_name(optimizer)} became {_momentum_of(changed[0], beta1)} after "
                f"the hook took it over as {state.feedback.momentum if beta1 is None else beta1} (a scheduler "
                f"cycling momentum, as OneCycleLR and CyclicLR do by default): {CYCLED_MOMENTUM}"
            )
            return
        saved = max((group[HOOK_STEP_KEY] for group in groups if HOOK_STEP_KEY in group), default=None)
        if self.first and saved is not None and state.ledger.step <= saved:
            warnings.warn(
                f"gradsift: this optimizer was saved at the hook's step {saved}, while the hook held its "
                f"momentum, but the hook is at step {state.ledger.step}: the hook's state saved with it (each "
                "rank's velocity and residuals) was not loaded, so they start from zero and this run departs "
                "from the one saved; save it beside the optimizer's and load it before training "
                "(gradsift.integrations.checkpoint.gather_hook_states / load_hook_state)",
                stacklevel=4,
            )
        self.first = False
        if state.adam is None or not state.warming():  # the hook holds the velocity
            for group in groups:
                group[HOOK_STEP_KEY] = state.ledger.step


def _momentum_of(group: dict[str, Any], beta1: float | None) -> float:
    """The group's momentum as the optimizer would apply it: SGD's ``momentum`` (``beta1``
    None), else Adam's first beta."""
    return float(group.get("momentum", 0.0)) if beta1 is None else float(group["betas"][0])
