"""One synchronised step of the hook as a transaction: open, collect buckets, close.

The first bucket of a backward opens the step: the state store begins a transaction
and the compressor's (small) ``snapshot()`` is kept, and a callback is queued on the
autograd engine to close the step once every bucket has been handed to DDP (the
engine runs it before DDP's own end-of-backward callback, which DDP queues when its
last bucket is ready). The hook hands DDP futures of its own; closing, on the thread
that ran backward, waits for the buckets' exchanges (:class:`Pending`: no Python runs
on the backend's threads), completes those futures and, on every rank alike (every
exchange delivers the non-finite flag to all ranks):

* a collective failed -> state rolled back, :class:`PeerFailureError` raised;
* a received message was malformed -> state rolled back, that error raised;
* some rank's gradient held NaN/Inf -> state rolled back (residuals, velocities, VGC's
  accumulators, the compressor's adaptation and generators: as if the step never
  happened; ``step`` does not advance), then the ``nonfinite`` policy:
  ``"propagate"`` fills every bucket's result with NaN, so the gradients DDP writes are
  non-finite on every rank, exactly what ``torch.amp.GradScaler`` looks for to skip the
  optimizer step and back off its scale (and what stock DDP delivers);
  ``"skip"`` fills them with zeros; ``"raise"`` raises :class:`NonFiniteGradientError`;
* otherwise the transaction commits, state of keys no bucket used is dropped, and the
  step counter advances.
DDP copies the bucket results into ``.grad`` after this callback. The step's
collectives' ``Work`` handles stay with :data:`~gradsift.exchanges.collectives.KEPT_WORKS`
until the next step opens (past interpreter exit for the last step), so a backend
thread never drops the last reference to one (docs/decisions.md, "Clean exit").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsift.compressors.base import Compressor
from gradsift.errors import NonFiniteGradientError
from gradsift.exchanges.base import waited
from gradsift.exchanges.collectives import KEPT_WORKS, Pending
from gradsift.state import TensorStore
from gradsift.telemetry import BucketRecord, Telemetry

NONFINITE_POLICIES = ("propagate", "skip", "raise")


@dataclass
class BucketInFlight:
    """One bucket handed to DDP: the future DDP waits for, the exchange that will produce
    its result, telemetry, and failures found while reading the result."""

    future: torch.futures.Future[torch.Tensor]
    pending: Pending[torch.Tensor]
    record: BucketRecord
    errors: list[BaseException] = field(default_factory=list)


@dataclass
class OpenStep:
    """The step in progress: the compressor's state at its start, its buckets and keys."""

    compressor_state: dict[str, Any]
    buckets: list[BucketInFlight] = field(default_factory=list)
    keys: set[Hashable] = field(default_factory=set)


@dataclass
class StepLedger:
    """Step counting and the per-step transaction of one hook (plain data plus two verbs).

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
            self.current = OpenStep(compressor_state=compressor.snapshot())
            store.begin()
            torch.autograd.Variable._execution_engine.queue_callback(on_close)
        return self.current

    def abort(self, compressor: Compressor, store: TensorStore) -> None:
        """Forget the step in progress (a bucket raised): roll its state back."""
        if self.current is not None:
            _roll_back(self.current, compressor, store)
            _fail(self.current, RuntimeError("gradsift: the step was abandoned (a bucket raised)"))
            self.current = None

    def close(self, compressor: Compressor, store: TensorStore, telemetry: Telemetry) -> None:
        """Wait for the step's buckets, apply the failure and non-finite policies, commit."""
        step, self.current = self.current, None
        if step is None:
            return
        results = []
        try:
            for bucket in step.buckets:
                results.append(waited(bucket.record, bucket.pending))
                if bucket.errors:
                    raise bucket.errors[0]
        except BaseException as failure:
            _roll_back(step, compressor, store)
            _fail(step, failure)
            raise
        records = [bucket.record for bucket in step.buckets]
        nonfinite = any(record.nonfinite for record in records)
        if nonfinite:
            _roll_back(step, compressor, store)
            if self.nonfinite == "raise":
                refusal = NonFiniteGradientError(
                    f"step {self.step}: a gradient holds NaN or Inf on at least one rank; every rank raises "
                    "(nonfinite='propagate', the default, hands NaN gradients to the optimizer as stock DDP "
                    "does, for torch.amp.GradScaler; nonfinite='skip' zeroes them)"
                )
                _fail(step, refusal)
                raise refusal
            for result in results:
                result.fill_(self.fill_value)
        else:
            store.commit()
            if step.keys:
                store.retain(step.keys)
        for bucket, result in zip(step.buckets, results, strict=True):
            bucket.future.set_result(result)
        self.last_step_skipped = nonfinite
        telemetry.end_step(self.step, records, skipped=nonfinite)
        self.step += int(not nonfinite)


def _roll_back(step: OpenStep, compressor: Compressor, store: TensorStore) -> None:
    store.rollback()
    compressor.restore(step.compressor_state)


def _fail(step: OpenStep, error: BaseException) -> None:
    """Complete every future DDP may still wait for with ``error``."""
    for bucket in step.buckets:
        if not bucket.future.done():
            bucket.future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong
