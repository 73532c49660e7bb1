"""One all-or-nothing change of the hook's state: the one transaction of a step.

A step changes three kinds of state: the tensors of the state store (residuals,
velocities, accumulators: :mod:`gradsift.core.store`), a compressor's small host state
(SIDCo's stage counts, generators: its ``snapshot()``), and the host updates decided
from what the step reads (:class:`~gradsift.core.readout.Readout`'s deferred updates).
A :class:`Transaction` opens all three together and then either commits them all or
rolls them all back. The hook's step (:mod:`gradsift.hook.ledger`) is one, settled by its
own policies; a compressor's public ``compress`` call is another, which joins the store's
open transaction when there is one instead of opening its own, and ends in
:meth:`Transaction.settle` (the one host read, then commit, or roll back on a dropped
flag), as the benchmarks' step does (:mod:`gradsift.tools.benchmarking.hook_encoder`).
"""

from __future__ import annotations

from typing import Any, Protocol

from gradsift.core.readout import Readout, Slot
from gradsift.core.store import TensorStore


class Snapshotting(Protocol):
    """What keeps small host state that a dropped step must return to (a compressor)."""

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, snapshot: dict[str, Any]) -> None: ...


class Transaction:
    """Open on construction: the store's transaction (unless one is already open, which it
    then leaves to its owner), ``participant``'s snapshot, and a fresh :attr:`readout`."""

    def __init__(self, store: TensorStore, participant: Snapshotting) -> None:
        self.store = store
        self.participant = participant
        self.readout = Readout()
        self.owns_store = not store.in_transaction
        if self.owns_store:
            store.begin()
        self.snapshot = participant.snapshot()

    def commit(self) -> None:
        """Keep everything: the store's writes, then the readout's deferred updates."""
        if self.owns_store:
            self.store.commit()
        self.readout.commit()

    def roll_back(self) -> None:
        """Drop everything: the store as at the start, the participant's snapshot restored,
        the readout's deferred updates forgotten."""
        if self.owns_store:
            self.store.rollback()
        self.participant.restore(self.snapshot)
        self.readout.discard()

    def settle(self, dropped: Slot | None = None) -> bool:
        """Read the readout (the step's one host read), then roll back when ``dropped`` -- a
        flag registered with it -- holds, else commit; True when the step is kept."""
        self.readout.read()
        if dropped is not None and dropped[0]:
            self.roll_back()
            return False
        self.commit()
        return True
