"""One synchronised step of the hook as a transaction: open, collect buckets, close.

The first bucket of a backward opens the step: the state store begins a transaction,
the compressor's (small) ``snapshot()`` is kept, a :class:`~gradsift.core.readout.Readout`
collects the device facts the step will need on the host, and a callback is queued on
the autograd engine that closes the step once backward ends, if nothing closed it
before. The DDP hook closes it itself on DDP's last bucket (``GradBucket.is_last()``):
DDP waits for the hook's futures when its own end-of-backward work runs, which with
``static_graph=True`` is *inside* an engine callback queued before ours -- a future
completed only by our callback would never complete.

The hook hands DDP futures of its own; closing, on the thread that ran backward, waits
for the buckets' exchanges (:class:`Pending`: no Python runs on the backend's threads),
then reads the step's readout once -- every bucket's non-finite and malformed flags,
the device-valued telemetry, the compressors' deferred facts, in one transfer, the only
host read of the step -- completes those futures and, on every rank alike (every
exchange delivers the same flags to all ranks):

* a collective failed -> state rolled back, :class:`PeerFailureError` raised;
* a received message was malformed -> state rolled back, :class:`WireFormatError` raised;
* (every raised step also sets the ``.grad`` of the step's parameters to None, so no rank
  keeps its own, unsynchronised gradient; DDP runs no further backward after its hook
  failed, so the job must stop: :data:`STOP`, said in the errors);
* some rank's gradient held NaN/Inf -> state rolled back (residuals, velocities, VGC's
  accumulators, the compressor's adaptation and generators: as if the step never
  happened; ``step`` does not advance), then the ``nonfinite`` policy:
  ``"propagate"`` fills every bucket's result with NaN, so the gradients DDP writes are
  non-finite on every rank, exactly what ``torch.amp.GradScaler`` looks for to skip the
  optimizer step and back off its scale (and what stock DDP delivers);
  ``"skip"`` fills them with zeros; ``"raise"`` raises :class:`NonFiniteGradientError`;
* otherwise the transaction commits, the readout's deferred updates run (SIDCo's stage
  choice, the adaptive capacities), state of keys no bucket used is dropped, and the
  step counter advances.
DDP copies the bucket results into ``.grad`` after this. The step's collectives'
``Work`` handles stay with :data:`~gradsift.core.collectives.KEPT_WORKS` until the
next step opens (past interpreter exit for the last step), so a backend thread never
drops the last reference to one (docs/decisions.md, "Clean exit").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.collectives import KEPT_WORKS, Pending
from gradsift.core.errors import NonFiniteGradientError, WireFormatError
from gradsift.core.readout import Readout, Slot
from gradsift.core.store import TensorStore
from gradsift.core.telemetry import BucketRecord, Telemetry
from gradsift.core.transaction import Transaction
from gradsift.core.trip import Outcome
from gradsift.exchanges.base import waited
from gradsift.hook.capacity import CapacityPlan

NONFINITE_POLICIES = ("propagate", "skip", "raise")
#: What a raised step leaves, and what the caller can do (every rank raises alike).
STOP = (
    "Every rank raises this from backward(): the hook's state is rolled back and the .grad of "
    "the step's parameters is None, so no rank can step on gradients of its own. The job must "
    "stop: DDP runs no further backward once its communication hook failed (its reducer keeps "
    "the failed step); restart from the last checkpoint."
)


@dataclass
class BucketInFlight:
    """One bucket handed to DDP: the future DDP waits for, the exchange that will produce
    its outcome, the tensor its result lands in, its telemetry, and its parameters (whose
    ``.grad`` a raised step clears)."""

    future: torch.futures.Future[torch.Tensor]
    pending: Pending[Outcome]
    result: torch.Tensor
    record: BucketRecord
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class OpenStep:
    """The step in progress: its transaction (store, compressor snapshot, readout), buckets and keys."""

    transaction: Transaction
    buckets: list[BucketInFlight] = field(default_factory=list)
    keys: set[Hashable] = field(default_factory=set)

    @property
    def readout(self) -> Readout:
        return self.transaction.readout


@dataclass
class _Checks:
    """The step's flags as registered with its readout."""

    nonfinite: list[Slot] = field(default_factory=list)
    malformed: list[Slot] = field(default_factory=list)
    demands: list[tuple[Hashable, int, Slot, Slot]] = field(default_factory=list)


@dataclass
class StepLedger:
    """Step counting and the per-step transaction of one hook (plain data plus three verbs).

    Attributes:
        step: synchronised steps applied so far (a dropped non-finite step does not count).
        last_step_skipped: the last step was dropped for a non-finite gradient.
        current: the step in progress, or None between steps.
    """

    nonfinite: str = "propagate"
    step: int = 0
    last_step_skipped: bool = False
    current: OpenStep | None = None

    @property
    def fill_value(self) -> float:
        """What a dropped step's results hold: NaN under ``"propagate"``, 0 under ``"skip"``."""
        return float("nan") if self.nonfinite == "propagate" else 0.0

    def open(self, compressor: Compressor, store: TensorStore, on_close: Callable[[], None]) -> OpenStep:
        """Open the step on its first bucket (later buckets get the same :class:`OpenStep`)."""
        if self.current is None:
            KEPT_WORKS.next_step()
            self.current = OpenStep(Transaction(store, compressor))
            if torch._C._current_graph_task_id() != -1:  # inside backward (outside it: the caller closes)
                torch.autograd.Variable._execution_engine.queue_callback(on_close)
        return self.current

    def abort(self) -> None:
        """Forget the step in progress (a bucket raised): roll its state back."""
        if self.current is not None:
            self.current.transaction.roll_back()
            _refuse(self.current, RuntimeError("gradsift: the step was abandoned (a bucket raised)"))
            self.current = None

    def close(self, telemetry: Telemetry, capacities: CapacityPlan) -> None:
        """Wait for the step's buckets, read its checks once, apply the failure and
        non-finite policies, commit (a no-op when no step is open)."""
        step, self.current = self.current, None
        if step is None:
            return
        outcomes = []
        try:
            for bucket in step.buckets:
                outcome = waited(bucket.record, bucket.pending, bucket.result.device)
                outcomes.append(outcome)
                if outcome.error is not None:
                    raise outcome.error
        except BaseException as failure:
            step.transaction.roll_back()
            _refuse(step, failure)
            raise
        checks = _register(step, outcomes)
        step.readout.read()  # the step's one host read
        running = [phase for bucket in step.buckets for phase in bucket.record.settle()]
        records = [bucket.record for bucket in step.buckets]
        nonfinite = any(slot[0] for slot in checks.nonfinite)
        if not nonfinite:  # a non-finite input may break a payload's own rules (VGC's scale): not malformed
            malformed = sorted(
                {rank for slot in checks.malformed for rank, bad in enumerate(slot.values) if bad}
            )
            if malformed:
                step.transaction.roll_back()
                error = WireFormatError(
                    f"step {self.step}: a malformed message arrived from rank(s) {malformed} of the group "
                    "(a length beyond the payload's capacity, an index out of range or repeated, or an "
                    f"encoding the compressor rejects: a corrupt link, or ranks running other code). {STOP}"
                )
                _refuse(step, error)
                raise error
        if nonfinite:
            step.transaction.roll_back()
            if self.nonfinite == "raise":
                refusal = NonFiniteGradientError(
                    f"step {self.step}: a gradient holds NaN or Inf on at least one rank. {STOP} To train on "
                    "past such steps instead, register the hook with nonfinite='skip' (the step's gradients "
                    "are zero on every rank) or 'propagate', the default (NaN gradients, as stock DDP hands "
                    "them to torch.amp.GradScaler)"
                )
                _refuse(step, refusal)
                raise refusal
            for bucket in step.buckets:
                bucket.result.fill_(self.fill_value)
        else:
            step.transaction.commit()
            for key, numel, demand, used in checks.demands:
                capacities.follow(key, demand[0], used[0], numel)
            if step.keys:
                step.transaction.store.retain(step.keys)
        for bucket in step.buckets:
            bucket.future.set_result(bucket.result)
        self.last_step_skipped = nonfinite
        telemetry.end_step(self.step, records, skipped=nonfinite, running=running)
        self.step += int(not nonfinite)


def _register(step: OpenStep, outcomes: list[Outcome]) -> _Checks:
    """Hand every bucket's flags, demands and device-valued telemetry to the step's readout."""
    checks = _Checks()
    readout = step.readout
    for bucket, outcome in zip(step.buckets, outcomes, strict=True):
        if outcome.nonfinite:
            checks.nonfinite.append(readout.slot(torch.stack(outcome.nonfinite).any()))
        checks.malformed.extend(readout.slot(flags) for flags in outcome.malformed)
        for key, (demand, used, numel) in outcome.demands.items():
            checks.demands.append((key, numel, readout.slot(demand), readout.slot(used)))
        bucket.record.register(readout)
    return checks


def _refuse(step: OpenStep, error: BaseException) -> None:
    """A raised step: fail DDP's futures with ``error`` and set the ``.grad`` of every parameter
    of the step's buckets to None, so that no rank keeps its own, unsynchronised gradient for
    an optimizer step taken after catching the error."""
    _fail(step, error)
    for bucket in step.buckets:
        for param in bucket.params:
            param.grad = None


def _fail(step: OpenStep, error: BaseException) -> None:
    """Complete every future DDP may still wait for with ``error``."""
    for bucket in step.buckets:
        if not bucket.future.done():
            bucket.future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong
