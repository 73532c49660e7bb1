"""``compressor="auto"``: measure the run, then run what is fastest among the methods that keep quality.

The hook starts as stock DDP (``none``: dense fp32 allreduce, the optimizer as built); at
the first bucket, with the optimizer found, the measuring steps run the family's start
method (:data:`~gradsift.hook.choice.START`: ``sidco-exp`` under SGD, as
``register_comm_hook(ddp, "sidco-exp", ratio=0.01, optimizer=...)`` would, with the
``density_warmup_steps`` given; else stock DDP). It decides after step :data:`DECIDE_AT`
(sooner when the steps are slow: :data:`MEASURE_SECONDS`; later by a density warm-up's
steps), on every rank alike:

1. **Measure** -- the step time ``T`` of the running method (median of the intervals between
   the first buckets of steps :data:`SKIP` .. :data:`DECIDE_AT`, both after a density warm-up;
   on CUDA each synchronises once, so host clocks see device time), the route those steps
   paid (its telemetry, :mod:`gradsift.hook.paid`), and each candidate's route time: the
   deciding step's buckets, copied before their exchange, through the candidate's whole
   route -- its real collectives on this group included -- or, for ``none``, stock DDP's
   allreduce of them (:mod:`gradsift.hook.probes`: once untimed, then the median of
   :data:`~gradsift.hook.probes.PROBES` rounds of every probe in turn). The probes run after
   the optimizer's step (a step post-hook), outside backward; with no optimizer found, at
   the next step's first bucket.
2. **Agree** -- every rank's numbers are reduced by ``max`` in one collective, so every
   rank predicts from the same numbers and picks the same candidate.
3. **Predict** -- ``T(c) = T - k(s) + k(c)`` per candidate, ``s`` the running method: its
   step with its route exchanged for the candidate's, ``k`` a probed route time less what the
   probe of ``s`` counted beyond what its steps paid (:func:`~gradsift.hook.choice.choose`).
4. **Choose** -- the least predicted time; a candidate other than ``none`` must beat
   ``none``'s predicted step by :data:`~gradsift.hook.choice.MARGIN`, so a near tie runs
   dense (the hook is never the reason a run is slower); if that is not the start method,
   the run switches to it from the next step (:mod:`gradsift.hook.handover`: leaving a
   method with error feedback gives the optimizer its momentum or moments back). Each rank
   logs the choice and the predictions (``gradsift.hook`` logger, INFO).
5. **Watch** -- the step time of the running choice, in windows (:mod:`gradsift.hook.drift`);
   when it drifts from what the choice was made on, the next step's buckets are kept and
   probed again (1-4, with the window's median step and paid route). Needs the optimizer
   found: without one, the first choice stays.

The candidates (:mod:`gradsift.hook.choice`) keep the optimizer family's quality; the 1-bit
Adam method starts only after Adam's dense warm-up (``warmup_steps``, unset:
:data:`~gradsift.hook.adam.ONE_LINE_WARMUP_STEPS`). The chosen method runs as registered by
hand would, continuing the step count; its state, the choice and the predictions are in
``stats()`` and the checkpoint (not the drift windows: a resumed run starts a new one).
Under DDP's ``join()`` (uneven inputs) it makes no collective of its own: :mod:`gradsift.hook.uneven`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import logging
import statistics
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from gradsift.core.collectives import agreed_max
from gradsift.hook import choice, handover, probes, recipe, uneven
from gradsift.hook.auto_record import AutoRecord
from gradsift.hook.drift import DriftWatch
from gradsift.hook.lean import LeanAllreduce
from gradsift.hook.paid import PaidRoute
from gradsift.hook.rebuilt import SECOND, OptimizerFollower
from gradsift.hook.route import route_bucket
from gradsift.hook.state import GradsiftHookState

logger = logging.getLogger("gradsift.hook")

AUTO = "auto"
#: Dense steps not timed (step 0: allocator and first-call costs, DDP's bucket rebuild after
#: it), then the last step of the timing window: its median holds five intervals.
SKIP = 1
DECIDE_AT = 6
#: The dense steps end sooner on a slow step: the next step is the deciding one once the
#: timed steps, from step :data:`SKIP`'s first bucket to the end of the last optimizer step,
#: add up to this many seconds on the slowest rank (agreed after each optimizer step; a link
#: so slow that each dense step is costly): after step 1 when one step takes that long.
MEASURE_SECONDS = 0.5


class AutoHookState(AutoRecord):
    """The state of ``register_comm_hook(ddp)`` with ``compressor="auto"`` (module docstring).

    Attributes:
        dense: the ``none`` hook state the run starts with (and keeps when it wins).
        current: the state whose route the buckets take now.
        choice: ``"measuring"`` until the decision, then the chosen registry name.
        predicted_ms: per candidate, the predicted step time; ``measured_ms``: the parts.
    """

    def __init__(
        self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any, options: dict[str, Any]
    ) -> None:
        #: The run's length in steps (None: unknown), the start method's density warm-up.
        self.run_steps, self.density_warmup_steps, self.hook_options = choice.auto_options(options)
        self._ddp_model = weakref.ref(ddp_model)
        self.dense = GradsiftHookState.build("none", **self.hook_options)
        self.dense.attach(ddp_model, optimizer)
        self.current = self.dense
        self.choice = "measuring"
        self.decided_at: int | None = None
        self.switch_at: int | None = None
        self.pending: str | None = None
        self.switched_at: int | None = None
        self.predicted_ms: dict[str, float] = {}
        self.measured_ms: dict[str, float] = {}
        self._starts: list[float] = []
        #: The deciding step's buckets, copied before their exchange (up to ``_kept_limit``
        #: elements, :func:`~gradsift.hook.probes.kept_elements`), and whether they are complete.
        self._kept: list[probes.KeptBucket] = []
        self._kept_limit = probes.PROBE_ELEMENTS
        self._keeping = self._kept_all = self._keep_next = False  # _keep_next: for a re-measure
        #: The running choice's step-time windows (:mod:`gradsift.hook.drift`) and re-measures made.
        self.watch: DriftWatch | None = None
        self.remeasures = 0
        #: The methods left for what the script does that they cannot follow, with what: never picked again.
        self.left: dict[str, str] = {}
        self._paid = PaidRoute()  # the route the running method's steps paid, since a mark
        self._window_paid: float | None = None  # ... in the last drift window
        self.clock = time.perf_counter
        self._after_step: Any = None  # the optimizer step post-hook that decides
        self._follower: OptimizerFollower | None = None  # the optimizer found, through rebuilds
        self._follows = optimizer is None  # found, not given (a resumed run's is found at its load)
        #: Dense steps take stock DDP's allreduce with no more Python than PyTorch's own hook
        #: (:mod:`gradsift.hook.lean`), unless a ``nonfinite`` policy needs the route's checks.
        self.lean = self.dense.options.nonfinite == "propagate"
        self._lean_route = LeanAllreduce(self.dense)
        self._open = False  # a step's first bucket has arrived, its last not yet

    # -- the route -----------------------------------------------------------------------
    def route(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """One bucket: at a step's first bucket, the clock, the decision and the switch; then
        stock DDP's allreduce while dense (:mod:`gradsift.hook.lean`), or the running method's
        route (:func:`gradsift.hook.route.route_bucket`)."""
        if not self._open:
            self._open = True
            self._at_step_start(bucket)
        if self._keeping:
            self._keep(bucket)
        if bucket.is_last():
            self._open = False
        if self.lean and self.current is self.dense:
            return self._lean_route(bucket)
        return route_bucket(self.current, bucket)

    def _at_step_start(self, bucket: dist.GradBucket) -> None:
        step = self.current.step
        if self._after_step is None and self.choice != "measuring" and self.dense.optimizer is not None:
            self._watch_optimizer()  # a resumed run's choice, watched after its optimizer's steps
        if uneven.joined(self.ddp_model):  # no bucket kept, no collective of auto's own
            if self.choice == "measuring":
                self._run_dense(step)
        elif self._follower is not None and (found := self._follower.outcome()) is not None:
            self._follow(step, found)
        elif why := handover.found_added_groups(self.current):  # a group added the method cannot follow
            self._run_dense(step, why)
        elif self.choice == "measuring" and self._kept_all and self._after_step is None:  # no optimizer found
            self._decide(self._step_seconds(), self._paid.since_mark(self._timed_telemetry()))
        elif self.choice == "measuring" and not self._kept:
            if self.dense.discovering:
                self.dense.discover()
                if self.dense.optimizer is not None:  # decide after its step, outside backward
                    self._watch_optimizer()
                    self._start(step)
            if step >= self.timed_from:
                if bucket.buffer().is_cuda:
                    torch.cuda.synchronize(bucket.buffer().device)
                if not self._starts:
                    self._paid.mark(self._timed_telemetry())
                self._starts.append(self.clock())
            deciding = step >= self.timed_from + DECIDE_AT - SKIP
            self._keeping, self._keep_next = deciding or self._keep_next, False
        elif self._keep_next:
            self._keeping, self._keep_next = True, False
        if self.pending is not None and self.switch_at is not None and step >= self.switch_at:
            self._switch(self.pending, step)

    def _run_dense(self, step: int, why: str | None = None) -> None:
        """Run ``none`` from ``step``: under DDP's join while measuring (:mod:`~.uneven`), or when
        the running method's checks found ``why``, what it cannot follow
        (:func:`~gradsift.hook.handover.found_unfollowable`): that method is :attr:`left`."""
        if why is not None:
            self.left[self.current.compressor.name] = why
        if self.dense.discovering:  # the scaler and the optimizer, as stock DDP's steps use them
            self.dense.discover()
        self._kept, self._kept_all, self.choice, self.decided_at, self.watch = [], False, "none", step, None
        if self.current is not self.dense:
            if self.current.feedback is not None:
                handover.leave(self.current, self.dense)
            self.pending, self.switch_at = "none", step

    def _follow(self, step: int, found: Any) -> None:
        """The optimizer found was built again (``found``: the new one), or a second one steps
        beside it (:mod:`gradsift.hook.rebuilt`): adopt the new one and run the method again on
        it (after Adam's warm-up for the 1-bit method), or run stock DDP from ``step``."""
        handover.found_unfollowable(self.current)  # what was found of the old one goes with it
        if found is SECOND:  # followed no more; a method with a takeover leaves for stock DDP
            assert self._follower is not None
            self._follower.detach()
            self._follower = None
            if self.current.feedback is not None:
                warnings.warn(f"gradsift: {SECOND}; auto runs stock DDP's allreduce from here", stacklevel=2)
                self._run_dense(step, SECOND)
            return
        taken = self.current.feedback is not None  # a takeover: its momentum is the old optimizer's
        method = self.pending or (self.current.compressor.name if taken else None)
        if taken:
            handover.leave(self.current, self.dense)
            self._switch("none", step)
        self.dense.adopt(found, take_over=False)
        self._decide_after(found)
        if method is not None:  # entered again on the new one, after Adam's warm-up for the 1-bit method
            self.pending, self.switch_at = method, step + choice.dense_steps(found, method, self.hook_options)

    def _watch_optimizer(self) -> None:
        """Decide and watch after the steps of the optimizer found (followed through its rebuilds
        where ``auto`` found it itself)."""
        assert self.dense.optimizer is not None
        self._decide_after(self.dense.optimizer)
        if self._follows:
            self._follower = OptimizerFollower(self.dense.optimizer, self.dense.layout.numbers)
            self._followed(self.current)

    def _followed(self, state: GradsiftHookState) -> None:
        """Another optimizer stepping the model is the follower's to tell apart, not a finding of
        ``state``'s takeover (:mod:`gradsift.hook.rebuilt`)."""
        if self._follower is not None and state.taken_over is not None:
            state.taken_over.followed = True

    def _decide_after(self, optimizer: Any) -> None:
        """Decide and watch after ``optimizer``'s steps (its step post-hook), not another's."""
        if self._after_step is not None:
            self._after_step.remove()
        inner = recipe.unwrapped(optimizer)
        self._after_step = inner.register_step_post_hook(self._after_optimizer_step)

    @property
    def timed_from(self) -> int:
        """The first timed step: :data:`SKIP`, or the start method's first after its density warm-up."""
        return SKIP if self.measured_on == "none" else max(SKIP, self.density_warmup_steps)

    def _start(self, step: int) -> None:
        """Run the start method from ``step`` (the first), unless stock DDP or already switched."""
        if self.measured_on != "none" and self.switched_at is None:
            self._switch(self.measured_on, step)

    def _keep(self, bucket: dist.GradBucket) -> None:
        """Copy the deciding step's ``bucket`` for the probes, while the copies stay within the
        agreed limit (the first bucket always)."""
        buffer = bucket.buffer()
        kept = sum(k.flat.numel() for k in self._kept)
        if not self._kept or kept + buffer.numel() <= self._kept_limit:
            self._kept.append(probes.KeptBucket(buffer.detach().clone(), list(bucket.parameters())))
        if bucket.is_last():
            self._keeping, self._kept_all = False, True

    # -- deciding ------------------------------------------------------------------------
    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook (outside backward): decide once the deciding step's
        buckets are kept; then watch the step time and re-measure when it drifts
        (:mod:`gradsift.hook.drift`) -- the next step's buckets kept, decided after its step.
        Nothing under DDP's join (:mod:`gradsift.hook.uneven`)."""
        if uneven.joined(self.ddp_model):
            return
        if why := handover.found_unfollowable(self.current):  # SGD's momentum as the script has it
            self._run_dense(self.current.step, why)
        if self._kept_all:
            first = self.choice == "measuring"
            paid = self._paid.since_mark(self._timed_telemetry()) if first else self._window_paid
            self._decide(self._step_seconds() if first else self._watch().last or 0.0, paid, first)
            return
        if self.choice == "measuring":
            if not self._keeping and self._starts:  # slow steps: measured enough?
                (timed,) = self._agreed([self.clock() - self._starts[0]])
                self._keep_next = timed >= MEASURE_SECONDS
                self._kept_limit = probes.kept_elements(self._numel(), timed / len(self._starts))
            return
        if self.pending is not None or self.choice not in self.predicted_ms:  # no prediction to watch
            return
        median = self._watch().tick(self.clock())
        if median is not None:
            self._window_paid = self._paid.since_mark(self._timed_telemetry())
        if median is None or not self._watch().due(self._agreed([median])[0]):
            return
        self._keep_next = True
        self._kept_limit = probes.kept_elements(self._numel(), self._watch().last or 0.0)

    def _watch(self) -> DriftWatch:
        """The running choice's :class:`~gradsift.hook.drift.DriftWatch`, from its predicted step."""
        if self.watch is None:  # its windows, and the route they paid, count from here
            self.watch = DriftWatch(self.predicted_ms[self.choice] / 1e3)
            self._paid.mark(self._timed_telemetry())
        return self.watch

    def _agreed(self, values: list[float]) -> list[float]:
        """Every rank's ``values``, reduced by ``max`` over the group (one collective)."""
        return agreed_max(values, self.dense.process_group, "auto's agreement")

    def _timed_telemetry(self) -> Any:
        """The running method's telemetry, None on stock DDP's lean allreduce (not timed)."""
        return None if self.lean and self.current is self.dense else self.current.telemetry

    @property
    def ddp_model(self) -> Any:
        """The hooked model, held weakly: DDP's reducer holds this state from C++, unseen by the
        garbage collector, so a strong reference back would keep the model (its optimizer, its
        scaler) alive after the script let go of them."""
        return self._ddp_model()

    def _decide(self, step_s: float, paid_s: float | None, first: bool = True) -> None:
        """Steps 1-4 of the module docstring from the measuring steps' time ``step_s``
        (``first``), or a re-measure's from the running method's drifted window, with the route
        its steps paid, ``paid_s`` (None: not timed): the kept buckets probed, the numbers
        agreed, the choice made (a switch from the next step or after Adam's warm-up)."""
        numel = self._numel()
        candidates = self.candidates()
        names = [name for name, _ in candidates]
        setting = probes.Setting(
            self.ddp_model.module,
            self.dense.process_group,
            {
                **{k: v for k, v in self.hook_options.items() if k in choice.PROBED},
                "scaler": self.dense.options.scaler,
            },
            choice.sgd_momentum(self.dense.optimizer),
        )
        started = time.perf_counter()
        costs = probes.route_costs(candidates, self._kept, numel, setting)
        step_s, paid, probing, *routes = self._agreed(
            [step_s, -1.0 if paid_s is None else paid_s, time.perf_counter() - started, *costs])  # fmt: skip
        paid_s = None if paid < 0 else paid  # every rank times its route, or none does
        route = dict(zip(names, routes, strict=True))
        running = self.current.compressor.name
        best, predicted = choice.choose(step_s, route, running, "none" if first else running, paid_s)
        self.predicted_ms = {n: 1e3 * seconds for n, seconds in predicted.items()}
        cost = choice.running_cost(route[running], paid_s)
        self.measured_ms = {"step": 1e3 * step_s, "compute": 1e3 * max(step_s - cost, 0.0)}
        self.measured_ms.update({f"route {n}": 1e3 * route[n] for n in names})
        if paid_s is not None:
            self.measured_ms[f"route {running} paid"] = 1e3 * paid_s
        self.measured_ms["probing"] = 1e3 * probing  # the probes' own wall time, once
        self.decided_at = self.current.step
        self.remeasures += not first
        self.watch = None  # the next window is expected at the new choice's predicted step
        self.choice = best
        self._kept, self._kept_all = [], False
        if best != running:
            if self.current.feedback is not None:
                handover.leave(self.current, self.dense)
            self.pending = best
            self.switch_at = max(
                self.decided_at, choice.dense_steps(self.dense.optimizer, best, self.hook_options)
            )
        logger.info(
            "gradsift auto %s %s at step %d%s; predicted ms per step: %s",
            "chose" if first else "measured again and chose",
            best,
            self.decided_at,
            ""
            if best == running or self.switch_at == self.decided_at
            else f", from step {self.switch_at} on",
            ", ".join(f"{name} {ms:.1f}" for name, ms in self.predicted_ms.items()),
        )

    def _numel(self) -> int:
        return sum(p.numel() for p in self.dense.hooked if p.requires_grad)

    def candidates(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """The candidates for the optimizer found (module docstring) with their options, none :attr:`left`."""
        kind = choice.family(self.dense.optimizer, self.dense.layout.numbers)
        long_run = self.run_steps is not None and self.run_steps >= choice.LONG_RUN_STEPS
        found = choice.CANDIDATES[kind] + ((choice.ONE_BIT_ADAM,) if kind == "adam" and long_run else ())
        return tuple(candidate for candidate in found if candidate[0] not in self.left)

    def _step_seconds(self) -> float:
        """The median interval between the timed steps' first buckets."""
        return statistics.median(b - a for a, b in zip(self._starts, self._starts[1:], strict=False))

    def _switch(self, name: str, step: int) -> None:
        """Run ``name`` from ``step`` on, as ``register_comm_hook(ddp, name, optimizer=...)``
        would with the ``step`` steps before as its dense warm-up (``none``: the dense state,
        stock DDP's allreduce)."""
        if name == "none":
            state = self.dense
        else:
            options = dict(dict(self.candidates())[name])
            hook_options = {k: v for k, v in self.hook_options.items() if k in choice.PASSED_ON}
            if self.density_warmup_steps and "ratio" in options:
                hook_options[choice.DENSITY_WARMUP] = self.density_warmup_steps
            state = handover.enter(self.ddp_model, self.dense, name, options, hook_options, step)
            self._followed(state)
        state.ledger.step = step
        state.telemetry.load_state_dict(self.current.telemetry.state_dict())
        if self.current.first_step is not None:
            self.current.first_step.close()
        self.current, self.pending, self.switched_at = state, None, step


def auto_hook(state: AutoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of ``compressor="auto"``."""
    return state.route(bucket)
