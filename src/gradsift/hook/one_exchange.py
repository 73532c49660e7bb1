"""Under a momentum taken over from the optimizer, one kept exchange per optimizer step.

Momentum correction (:mod:`gradsift.hook.recipe`) and the Adam methods (:mod:`gradsift.hook.adam`)
advance the hook's velocity at every exchange, ``u <- m u + g``. Stock DDP's gradient
accumulation -- several backward passes, each allreducing, then one optimizer step -- is exact
by linearity (``mean(a) + mean(b) = mean(a + b)``); under the hook each pass is a step of the
velocity, so momentum is applied once per pass, not once per optimizer step, and a pass whose
gradients the optimizer never steps (a GAN's discriminator during the generator's pass) still
moves it. :class:`OneExchangePerStep` reads the kept exchanges of a hook since the optimizer it
took over last stepped (its ledger's ``kept_since``: a dropped step, which a ``GradScaler``
skips, is none) at that optimizer's step, before the step, and raises
:class:`~gradsift.core.errors.InvalidOptionError` when there were more than one: every rank
alike, since the ranks' steps and exchanges are the same. A rank that joined under DDP's
``join()`` steps no optimizer, so it is never checked.
"""

from __future__ import annotations

import weakref
from typing import Any

from gradsift.core.errors import InvalidOptionError
from gradsift.hook.before_step import BEFORE_STEP


class OneExchangePerStep:
    """The check of the module docstring for one hook ``state`` (a
    :class:`~gradsift.hook.state.GradsiftHookState` whose optimizer's momentum it took over)."""

    def __init__(self, state: Any) -> None:
        self.state = weakref.ref(state)  # the state holds this check: no cycle keeps either alive
        self.hooked = {id(p) for p in state.hooked}  # alive while the state is
        BEFORE_STEP.add(self)  # after the state, which settles its closed step first

    def before_step(self, optimizer: Any) -> None:
        state = self.state()
        if state is None or not any(
            id(p) in self.hooked for g in optimizer.param_groups for p in g["params"]
        ):
            return
        exchanges, state.ledger.kept_since = state.ledger.kept_since, 0
        if exchanges > 1:
            raise InvalidOptionError(
                f"{exchanges} exchanges of the hook's gradients before one step of the optimizer whose "
                "momentum it took over (one per backward pass): each advances the hook's velocity, so "
                "momentum would be applied per pass. Accumulate gradients under ddp_model.no_sync() for "
                "all but the last micro-batch (its one exchange carries their sum), and run a backward "
                "whose gradients this optimizer does not step (a GAN's discriminator in the generator's "
                "pass) under no_sync() too; or register the hook with optimizer=False"
            )
