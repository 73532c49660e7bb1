"""0/1 Adam's local steps: the frozen-variance method synchronised once every ``H`` steps.

``register_comm_hook(ddp, "efsignsgd", optimizer=adamw, adam="zero-one", warmup_steps=...)``
runs the frozen-variance method's warm-up (:mod:`gradsift.hook.adam`: dense, or in a code
with ``warmup_compressor=``) and then, after 0/1 Adam (Lu et al. 2022), lets the workers
step on their own between synchronisations. With ``D`` frozen at the warm-up's end (the
method's ``sqrt(v) + eps``), a single learning rate ``gamma_t`` over the model's parameter
groups and ``beta1`` Adam's, each worker ``k`` keeps a velocity ``u_k`` (started from the
warm-up's first moment in velocity units) and an accumulated update ``a_k`` (from zero);
every compressed step

    u_k <- beta1 u_k + g_k            a_k <- a_k + gamma_t u_k

(Adam's L2 decay in ``g_k`` as the method adds it); what a coded warm-up left in the
residuals (the worker's ``r_k``, the two-stage exchange's server chunks) is gradient mass, so
it enters at the first compressed step times ``gamma_t``, in the accumulated update's units.
A step that is not the last of its interval is **local**: nothing but a one-element
non-finite flag is exchanged, the hook hands DDP the worker's own first moment
``(1 - beta1) u_k``, and the optimizer's step moves the worker's parameters as the
frozen-variance method does,
``x_k <- x_k (1 - gamma_t wd) - gamma_t (1 - beta1) u_k / D``. The interval's last step
**synchronises**: ``a_k`` travels through the compressor with error feedback
(``c = a_k + r_k``), the exchange delivers the mean ``abar``, and with ``Gamma`` the sum of
``gamma`` over the interval every rank sets

    x <- xhat prod(1 - gamma wd) - (1 - beta1) abar / D,   xhat <- x,
    u_k <- abar / Gamma,                                    a_k <- 0,

``xhat`` the parameters the last synchronisation left (the anchor, kept beside the model), so
every replica holds the same parameters again, and the same velocity (0/1 Adam's momentum
from the synchronised update). DDP's gradient at a synchronisation is the mean first moment
``(1 - beta1) abar / Gamma``, so ``clip_grad_norm_`` scales the interval's update as it scales
a step's, and the step is ``x <- xhat prod(1 - gamma wd) - Gamma .grad / D``. With ``H = 1``
this is the frozen-variance method with 0/1 Adam's momentum.

The interval: ``local_steps=(double_every, longest)`` -- ``H = 1`` over the first
``double_every`` compressed steps, then ``2, 4, ...`` (an interval's length is fixed where it
starts: ``min(longest, 2^(s // double_every))`` for an interval starting ``s`` compressed steps
after the warm-up), at most ``longest``: 0/1 Adam's local-step policy.

Every step's non-finite flag is still exchanged, so a NaN on one rank drops the step on every
rank (the ``nonfinite`` policy, the step counts, the interval schedule stay agreed); a dead peer
raises there as in any step. Parameters of parts below ``min_numel`` travel by the stock
allreduce every step and step as the frozen-variance method steps them. The anchor and
``Gamma``'s running sum live in the optimizer's state (``optimizer.state_dict()``), the velocity,
the accumulated update and the residual in the hook's state store, so a run resumes bit for bit.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from gradsift.core.collectives import Pending
from gradsift.core.errors import InvalidOptionError
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.precision import working_dtype
from gradsift.exchanges.allreduce import any_nonfinite, start_mean_allreduce
from gradsift.exchanges.two_stage import SERVER_CHUNK
from gradsift.hook.adam import FrozenVarianceStep
from gradsift.hook.feedback import RESIDUAL
from gradsift.hook.param_groups import model_groups

#: State-store tables: each worker's velocity ``u_k`` and accumulated update ``a_k`` per part.
VELOCITY, ACCUMULATED = "adam.zero_one_velocity", "adam.zero_one_accumulated"
#: Optimizer-state keys: the anchor ``xhat`` and the interval's sum of learning rates so far.
ANCHOR, RATES = "gradsift_anchor", "gradsift_interval_lr_sum"

#: Residual tables a coded warm-up leaves in gradient units: the workers' and the two-stage
#: exchange's server chunks.
LEFT_BY_THE_WARMUP = (RESIDUAL, SERVER_CHUNK)

LocalSteps = tuple[int, int]
#: ``local_steps`` when ``adam="zero-one"`` is given without it (docs/decisions.md).
DEFAULT_LOCAL_STEPS: LocalSteps = (500, 2)


def parse_local_steps(value: Any) -> LocalSteps:
    """``local_steps`` as ``(double_every, longest)``, two ints >= 1; a clear error otherwise."""
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)
    ):
        raise InvalidOptionError(
            "local_steps= takes (double_every, longest), two ints >= 1: the interval between "
            f"synchronisations doubles every double_every compressed steps up to longest; got {value!r}"
        )
    return int(value[0]), int(value[1])


class ZeroOneAdamStep(FrozenVarianceStep):
    """The frozen-variance method with 0/1 Adam's local steps (module docstring).

    Args:
        local_steps: ``(double_every, longest)`` of the interval schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        numbers: dict[int, int],
        warmup_steps: int | None,
        local_steps: LocalSteps,
    ) -> None:
        super().__init__(optimizer, numbers, warmup_steps)
        self.double_every, self.longest = parse_local_steps(local_steps)
        #: The indices of the groups holding the model's parameters (``load_state_dict`` makes
        #: new group dicts, in the same order: read them through the optimizer each time), as
        #: of the optimizer's group count beside them (``add_param_group`` adds one).
        self._groups: list[int] = []
        self._counted = 0
        self.learning_rate()  # one rate over the model's groups, or refused here already
        #: The step in progress ends an interval (read by the optimizer's step that follows it).
        self.syncing = False
        self._anchored: set[int] = set()
        self._sample: torch.Tensor | None = None  # an anchored parameter: its state holds RATES
        self._ends: tuple[int, list[int]] | None = None

    def syncs(self, step: int) -> bool:
        """Whether compressed hook step ``step`` (0-based) ends an interval."""
        start = self.warmup_end
        if start is None or step < start:
            return False
        if self._ends is None or self._ends[0] != start:
            self._ends = (start, [start - 1])
        ends = self._ends[1]
        while ends[-1] < step:
            begin = ends[-1] + 1 - start  # the next interval's first compressed step
            ends.append(ends[-1] + min(self.longest, 2 ** (begin // self.double_every)))
        return ends[bisect.bisect_left(ends, step)] == step

    def learning_rate(self) -> float:
        """The one learning rate of the model's parameter groups now (host floats only)."""
        if len(self.optimizer.param_groups) != self._counted:  # a group added: look again
            self._counted = len(self.optimizer.param_groups)
            self._groups = [index for index, _, _ in model_groups(self.optimizer, self.numbers)]
        rates = {float(self.optimizer.param_groups[index]["lr"]) for index in self._groups}
        if len(rates) != 1:
            raise InvalidOptionError(
                f"adam='zero-one' accumulates the update at one learning rate; the model's parameter groups "
                f"use {sorted(rates)}: give them one (a scheduler may change it), or use adam='frozen-variance'"
            )
        return rates.pop()

    def span(self) -> float:
        """``Gamma``: the learning rates of the interval's steps so far and of this one."""
        state = {} if self._sample is None else self.optimizer.state.get(self._sample, {})
        return float(state.get(RATES, 0.0)) + self.learning_rate()

    def accumulate(
        self, store: Any, key: Any, gradient: torch.Tensor, params: Sequence[torch.Tensor], syncing: bool
    ) -> torch.Tensor:
        """``u <- beta1 u + g``, ``a <- a + gamma u`` for part ``key`` (put into ``store``, which
        rolls them back with a dropped step); what the step hands on: ``a`` when ``syncing``, else ``u``."""
        self._anchored.update(id(p) for p in params)
        if self._sample is None:
            self._sample = params[0]
        self.syncing = syncing  # for the optimizer's step after this one settles
        g = gradient.reshape(-1).to(working_dtype(gradient.dtype))
        velocity = store.get(VELOCITY, key)
        rate = self.learning_rate()
        if velocity is None:  # the first compressed step
            velocity = self.initial_velocity(params)
            for table in LEFT_BY_THE_WARMUP:  # what a coded warm-up has not delivered, gradient mass
                left = store.get(table, key)
                if left is not None:
                    store.put(table, key, left * rate)  # in the accumulated update's units from here
        velocity = g.clone() if velocity is None else torch.add(g, velocity, alpha=self.beta1)
        held = store.get(ACCUMULATED, key)
        accumulated = velocity * rate if held is None else torch.add(held, velocity, alpha=rate)
        store.put(VELOCITY, key, velocity)
        store.put(ACCUMULATED, key, accumulated)
        return accumulated if syncing else velocity

    def moment_scale(self, step: int) -> float:
        """A local step hands on ``u_k``: ``1 - beta1`` of it; a synchronisation ``abar``:
        ``(1 - beta1) / Gamma`` of it (the mean first moment)."""
        return (1.0 - self.beta1) / (self.span() if self.syncs(step) else 1.0)

    def exchanged(self, store: Any, key: Any, mean: torch.Tensor) -> None:
        """At a synchronisation: ``u <- abar / Gamma`` (the same on every rank), ``a <- 0``."""
        store.put(VELOCITY, key, mean.float() / self.span())
        store.discard(key, [ACCUMULATED])

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: a local step moves the worker's parameters by the frozen-variance
        update; a synchronisation sets them from the anchor (module docstring)."""
        if not self.pending:
            return
        self.pending, syncing = False, self.syncing
        with torch.no_grad():
            for group in optimizer.param_groups:
                rate, decay = float(group["lr"]), float(group["weight_decay"])
                keep = 1.0 - rate * decay if self.decoupled else 1.0
                for param in group["params"]:
                    if id(param) not in self.numbers or param.grad is None:
                        continue
                    direction = self.direction(param, group).to(param.dtype)
                    if id(param) not in self._anchored:  # a small part: synchronised every step
                        param.mul_(keep).sub_(direction, alpha=rate)
                    else:
                        self._anchored_step(optimizer.state[param], param, direction, rate, keep, syncing)
                    param.grad = None

    @staticmethod
    def _anchored_step(
        state: dict[str, Any],
        param: torch.Tensor,
        direction: torch.Tensor,
        rate: float,
        keep: float,
        syncing: bool,
    ) -> None:
        """One parameter's step against its anchor (created from the parameter at its first)."""
        anchor = state.get(ANCHOR)
        if anchor is None:
            anchor = state[ANCHOR] = param.detach().clone()
            state[RATES] = 0.0
        if keep != 1.0:
            anchor.mul_(keep)
        if syncing:
            param.copy_(anchor.sub_(direction, alpha=float(state[RATES]) + rate))
            state[RATES] = 0.0
        else:
            param.mul_(keep).sub_(direction, alpha=rate)
            state[RATES] = float(state[RATES]) + rate


def start_local_trip(parts: list[Part], context: Context) -> Pending[Outcome]:
    """A local step's trip of ``parts`` (their velocities as ``compensated``): each written into
    the bucket's result, and only a one-element flag -- some rank's input held a NaN or Inf --
    summed over the group, so every rank keeps or drops the step alike."""
    velocities = []
    for part in parts:
        assert part.compensated is not None  # the route compensated every part first
        part.view(context.result).copy_(part.compensated)
        velocities.append(part.compensated)
    flag = any_nonfinite(velocities).float().reshape(1)
    return start_mean_allreduce(flag, context.world, context.group, context.record).then(
        lambda total: Outcome.of(parts, [None] * len(parts), nonfinite=total[0] > 0)
    )
