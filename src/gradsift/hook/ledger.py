"""One synchronised step of the hook as a transaction: open, collect buckets, close, settle.

The first bucket of a backward opens the step: the state store begins a transaction,
the compressor's (small) ``snapshot()`` is kept, a :class:`~gradsift.core.readout.Readout`
collects the device facts the step will need on the host, and, for buckets that do not
say which is the step's last (FSDP's units), a callback is queued on the autograd engine
that closes the step once backward ends. The DDP hook closes it itself on DDP's last bucket
(``GradBucket.is_last()``), with no callback: DDP waits for the hook's futures when its own
end-of-backward work runs, which with ``static_graph=True`` is *inside* an engine callback
queued before ours -- a future completed only by our callback would never complete -- and
under reentrant activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``)
the first bucket can be ready inside the checkpoint's nested backward, whose own end would
run a callback queued there, closing the step before the buckets after it arrive. Where the
buckets do not say so (FSDP), a step that opens in an autograd graph task numbered below the
one the last step opened in -- the outer backward of a nested one, which the engine numbered
first -- is refused (:data:`NESTED_BACKWARD`).

**Close, on the device (during backward, no host read).** The hook hands DDP futures of
its own; closing waits for the buckets' exchanges (:class:`Pending`: no Python runs on
the backend's threads; on NCCL a stream dependency), joins every bucket's non-finite and
malformed flags into one device flag ``dropped`` (every exchange delivers the same flags
to all ranks), runs the outcomes' ``writes`` with it (a bucket that held new state until
the flag was known commits it gated on the flag, then gets its mean: error feedback's
velocity, :meth:`~gradsift.hook.feedback.ErrorFeedback.commit_in_result`), fills the
results where ``dropped`` holds -- ``result <- fill``
(:func:`~gradsift.core.finite.fill_where`), NaN (``nonfinite="propagate"``, also
``"raise"`` and a malformed message) or zeros (``"skip"``) -- completes the futures, and
starts the readout's copy to the host. A collective that failed (its ``wait`` raised) raises here: state rolled back,
:class:`PeerFailureError`.

**Settle, on the host (after backward returned).** The first of: an optimizer's step
(:mod:`gradsift.hook.before_step`), the hooked module's next forward, the next step's
open, or a read of the hook's state reads the step's readout once -- the only host read
of the step -- and, on every rank alike:

* a received message was malformed -> state rolled back, :class:`WireFormatError` raised;
* some rank's gradient held NaN/Inf -> state rolled back (residuals, velocities, VGC's
  accumulators, the compressor's adaptation and generators: as if the step never
  happened; ``step`` does not advance); under ``"raise"`` :class:`NonFiniteGradientError`;
  under ``"propagate"`` the NaN gradients DDP wrote are what ``torch.amp.GradScaler``
  looks for to skip the optimizer step and back off its scale (as stock DDP);
* (every raised step also sets the ``.grad`` of the step's parameters to None, so the
  optimizer step it was raised from cannot apply the filled gradients: :data:`STOP`);
* otherwise the transaction commits, the readout's deferred updates run (SIDCo's stage
  choice, the adaptive capacities), state of keys no bucket used is dropped, and the
  step counter advances.
The step's collectives' ``Work`` handles stay with
:data:`~gradsift.core.collectives.KEPT_WORKS` until the next step opens (past interpreter
exit for the last step), so a backend thread never drops the last reference to one
(docs/decisions.md, "Clean exit").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.collectives import KEPT_WORKS, Pending
from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError, WireFormatError
from gradsift.core.finite import fill_where
from gradsift.core.parts import Outcome
from gradsift.core.readout import Readout, Slot
from gradsift.core.store import TensorStore
from gradsift.core.telemetry import BucketRecord, Telemetry
from gradsift.core.transaction import Transaction
from gradsift.exchanges.base import wait_timed
from gradsift.hook.capacity import CapacityPlan

NONFINITE_POLICIES = ("propagate", "skip", "raise")
#: What a raised step leaves, and what the caller can do (every rank raises alike).
STOP = (
    "Every rank raises this at the same point, after backward (from optimizer.step(), the next "
    "forward or backward, or a read of the hook's state): the step is dropped on every rank -- "
    "the hook's state rolled back, the .grad of the step's parameters None, no optimizer step "
    "taken on it. Catching it on every rank and taking the next batch goes on in step; stop "
    "instead when the cause persists."
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
class _Checks:
    """The step's flags as registered with its readout."""

    nonfinite: list[Slot] = field(default_factory=list)
    malformed: list[Slot] = field(default_factory=list)
    demands: list[tuple[Hashable, int, Slot, Slot]] = field(default_factory=list)


#: Why a step that a nested backward's end closed is refused (buckets without a last one).
NESTED_BACKWARD = (
    "the hook's exchanges of one backward pass ran in two autograd graph tasks, the first nested in the "
    "second: reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True), "
    "checkpoint_wrapper with CheckpointImpl.REENTRANT, transformers 4.x's gradient_checkpointing_enable() "
    "without gradient_checkpointing_kwargs) runs a backward inside the backward, whose end closed the "
    "step before the rest of the model's gradients arrived. Under FSDP pass use_reentrant=False "
    "(PyTorch's advice; gradient_checkpointing_kwargs={'use_reentrant': False}); DDP's hook handles both"
)


@dataclass
class OpenStep:
    """The step in progress (then closed, until settled): its transaction (store, compressor
    snapshot, readout), buckets, keys, and the checks registered at its close."""

    transaction: Transaction
    buckets: list[BucketInFlight] = field(default_factory=list)
    keys: set[Hashable] = field(default_factory=set)
    checks: _Checks | None = None

    @property
    def readout(self) -> Readout:
        return self.transaction.readout


@dataclass
class StepLedger:
    """Step counting and the per-step transaction of one hook (plain data plus three verbs).

    Attributes:
        step: synchronised steps applied so far (a dropped non-finite step does not count).
        last_step_skipped: the last step was dropped for a non-finite gradient.
        current: the step in progress, or None between steps.
        closed: the step closed on the device and not yet settled on the host, or None.
        kept_since: steps kept since a reader last zeroed it (:mod:`gradsift.hook.taken_over`).
        opened_in: the autograd graph task the last step opened in (-1: outside backward).
    """

    nonfinite: str = "propagate"
    step: int = 0
    kept_since: int = 0
    last_step_skipped: bool = False
    current: OpenStep | None = None
    closed: OpenStep | None = None
    opened_in: int = -1

    @property
    def fill_value(self) -> float:
        """What a dropped step's results hold: NaN under ``"propagate"``, 0 under ``"skip"``."""
        return float("nan") if self.nonfinite == "propagate" else 0.0

    def open(
        self,
        compressor: Compressor,
        store: TensorStore,
        on_close: Callable[[], None],
        closes_itself: bool = False,
    ) -> OpenStep:
        """Open the step on its first bucket (later buckets get the same :class:`OpenStep`);
        ``closes_itself``: the step's buckets say which is the last (DDP's), and that one closes
        it, with no callback queued (module docstring)."""
        if self.closed is not None:
            raise RuntimeError("gradsift: a step opened before the last one was settled")
        if self.current is None:
            task = torch._C._current_graph_task_id()
            if -1 < task < self.opened_in:  # graph tasks are numbered as they start
                raise InvalidOptionError(NESTED_BACKWARD)
            KEPT_WORKS.next_step()
            self.current, self.opened_in = OpenStep(Transaction(store, compressor)), task
            if not closes_itself and task != -1:  # outside backward: the caller closes
                torch.autograd.Variable._execution_engine.queue_callback(on_close)
        return self.current

    def abort(self) -> None:
        """Forget the step in progress (a bucket raised): roll its state back."""
        if self.current is not None:
            self.current.transaction.roll_back()
            _refuse(self.current, RuntimeError("gradsift: the step was abandoned (a bucket raised)"))
            self.current = None

    def close(self) -> None:
        """Wait for the step's buckets, fill their results where the step is dropped, complete
        DDP's futures and start the readout's copy: no host read (a no-op when no step is
        open). :meth:`settle` finishes the step."""
        step, self.current = self.current, None
        if step is None:
            return
        outcomes = []
        try:
            for bucket in step.buckets:
                outcome = wait_timed(bucket.record, bucket.pending, bucket.result.device)
                outcomes.append(outcome)
                if outcome.error is not None:
                    raise outcome.error
            dropped = _dropped(outcomes)
            for outcome in outcomes:  # means that waited for the flag (state the buckets held)
                for write in outcome.writes:
                    write(dropped)
        except BaseException as failure:
            step.transaction.roll_back()
            _refuse(step, failure)
            raise
        step.checks = _register(step, outcomes)
        for bucket in step.buckets:
            if dropped is not None:
                fill_where(bucket.result, dropped, self.fill_value)
            bucket.future.set_result(bucket.result)
        step.readout.start()
        self.closed = step

    def settle(self, telemetry: Telemetry, capacities: CapacityPlan) -> bool:
        """Read the closed step's checks once, apply the malformed and non-finite policies,
        commit or roll back; True when a step was settled and kept (False: none waiting,
        or dropped)."""
        step, self.closed = self.closed, None
        if step is None or step.checks is None:
            return False
        checks = step.checks
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
                    "past such steps without an error, register the hook with nonfinite='skip' (the step's "
                    "gradients are zero on every rank) or 'propagate', the default (NaN gradients, as stock "
                    "DDP hands them to torch.amp.GradScaler)"
                )
                _refuse(step, refusal)
                raise refusal
        else:
            step.transaction.commit()
            for key, numel, demand, used in checks.demands:
                capacities.follow(key, demand[0], used[0], numel)
            if step.keys:
                step.transaction.store.retain(step.keys)
        self.last_step_skipped = nonfinite
        telemetry.end_step(self.step, records, skipped=nonfinite, running=running)
        self.step += int(not nonfinite)
        self.kept_since += int(not nonfinite)
        return not nonfinite


def _dropped(outcomes: list[Outcome]) -> torch.Tensor | None:
    """The step's device flag: some rank's input was non-finite or some message malformed
    (None when no exchange of the step checks either)."""
    flags = [flag.reshape(-1).bool() for o in outcomes for flag in (*o.nonfinite, *o.malformed)]
    return torch.cat(flags).any() if flags else None


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
    """A raised step: fail DDP's futures not yet completed with ``error`` and set the ``.grad``
    of every parameter of the step's buckets to None, so that no optimizer step applies the
    step's gradients."""
    _fail(step, error)
    for bucket in step.buckets:
        for param in bucket.params:
            param.grad = None


def _fail(step: OpenStep, error: BaseException) -> None:
    """Complete every future DDP may still wait for with ``error``."""
    for bucket in step.buckets:
        if not bucket.future.done():
            bucket.future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong
