"""A bucket's parts on their way: the parts, the context they travel in, and the outcome.

One bucket of one step travels as *parts* (:class:`Part`: the whole bucket, or one per
layer) in one frozen :class:`Context` (who the workers are, where the means go, the
state store, the step's readout, each part's payload capacity), built once per bucket
and step by the hook's layout (:mod:`gradsift.hook.layout`). Whatever moves the parts
(an exchange, or FSDP's reduce-scatter) reports one :class:`Outcome`; the step's close
(:mod:`gradsift.hook.ledger`) decides on the outcomes of all its buckets at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsift.core.payload import Payload
from gradsift.core.readout import Readout
from gradsift.core.store import TensorStore
from gradsift.core.telemetry import BucketRecord


@dataclass
class Part:
    """One exchanged piece of a bucket.

    Attributes:
        key: the state key (a parameter number, or the sorted tuple of a bucket's).
        offset: where the part starts in the bucket's flat gradient.
        flat: the local gradient of the part (a view into the bucket).
        params: the parameters it holds, in flattening order.
        compensated: the gradient with error feedback applied (``flat`` without it); None
            again once the exchange has copied what a lazily kept residual needs of it.
    """

    key: Hashable
    offset: int
    flat: torch.Tensor
    params: list[torch.Tensor]
    compensated: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def input(self) -> torch.Tensor:
        """What travels: the compensated gradient, or the plain one without error feedback."""
        return self.flat if self.compensated is None else self.compensated

    def view(self, result: torch.Tensor) -> torch.Tensor:
        """The part's slice of a bucket-sized tensor."""
        return result[self.offset : self.offset + self.numel]


@dataclass(frozen=True)
class Context:
    """Everything an exchange needs besides the parts (built once per bucket and step).

    Attributes:
        group / world / rank: the process group, its size and this worker's rank in it.
        result: the bucket-sized tensor the parts' means are written into.
        record: the bucket's telemetry (bytes, phase times).
        readout: the step's readout (device facts read once at step close).
        store: the hook's state store (exchanges that keep state put it there, under ``key``).
        key: the bucket's state key (the sorted tuple of its parameter numbers).
        order / numels: the bucket's parameter numbers in flat order, and each one's size.
        capacities: per part key, the entries its payload has room for this step.
        step: the hook's step counter (the same on every rank).
        bucket: the DDP ``GradBucket`` (the delegated exchange hands it to the compressor).
        before_mean: None, or what the hook runs on this worker's sent payloads once the
            step's flag ``dropped`` is known, before the means are written into ``result``:
            until then ``result`` holds the hook's new state (error feedback's velocity,
            :meth:`gradsift.hook.feedback.ErrorFeedback.commit_in_result`). Only an exchange
            that :attr:`~gradsift.exchanges.base.Exchange.defers_mean` is given one; it then
            leaves the call and its decode to the outcome's ``writes``.
    """

    group: Any
    world: int
    rank: int
    result: torch.Tensor
    record: BucketRecord
    readout: Readout = field(default_factory=Readout)
    store: TensorStore = field(default_factory=TensorStore)
    key: Hashable = None
    order: tuple[int, ...] = ()
    numels: Mapping[int, int] = field(default_factory=dict)
    capacities: Mapping[Hashable, int] = field(default_factory=dict)
    step: int = 0
    bucket: Any = None
    before_mean: Callable[[list[Payload], torch.Tensor | None], None] | None = None


@dataclass
class Outcome:
    """What a trip left for the step's close to decide on: the only result of an exchange,
    and of a whole bucket (:meth:`joined`).

    Attributes:
        sent: per part, what this worker's contribution stands for -- a payload whose
            ``indices`` name the delivered positions, a dense tensor, or None when the
            part travelled uncompressed (all of it was sent: nothing is left over).
        nonfinite: 0-d bool device flags: some worker's input held NaN/Inf (the same on
            every rank), one per trip that can tell. The result is then garbage and the
            step is dropped.
        malformed: ``[W]`` bool device flags: worker ``w``'s message broke the format
            (the result is then garbage, but nothing was written out of range).
        demands: per part key, ``(demand, used, numel)``: the most entries any worker
            wanted to send and the mean over workers of the entries sent (0-d device
            values; an adaptive-capacity compressor sizes its next payloads from them,
            :mod:`gradsift.hook.capacity`).
        error: a failure the host already knows (a collective failed), raised when the
            step closes.
        writes: what the close still runs once every bucket's flags are in, given the
            step's flag ``dropped`` (None: no trip can tell), in order: a mean written
            after the state its bucket held was committed (``Context.before_mean``), then
            what the route does to that mean.
    """

    sent: list[Payload | torch.Tensor | None] = field(default_factory=list)
    nonfinite: list[torch.Tensor] = field(default_factory=list)
    malformed: list[torch.Tensor] = field(default_factory=list)
    demands: dict[Hashable, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    error: BaseException | None = None
    writes: list[Callable[[torch.Tensor | None], None]] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        parts: Sequence[Part],
        sent: list[Payload | torch.Tensor | None],
        *,
        nonfinite: torch.Tensor | None = None,
        malformed: torch.Tensor | None = None,
        demand: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Outcome:
        """An exchange's outcome for ``parts``: its flags (None: it cannot tell), and its
        ``demand``: ``[P]`` device counts (the most entries any worker wanted to send) and
        ``[P]`` means (the entries sent), element ``i`` being part ``i``'s."""
        demands = {}
        if demand is not None:
            largest, used = demand
            demands = {p.key: (largest[i], used[i], p.numel) for i, p in enumerate(parts)}
        return cls(
            sent,
            [] if nonfinite is None else [nonfinite],
            [] if malformed is None else [malformed],
            demands,
        )

    @classmethod
    def joined(cls, outcomes: Iterable[Outcome]) -> Outcome:
        """One outcome of several trips (a bucket's compressed and dense parts): everything
        concatenated, the first error kept."""
        joined = cls()
        for outcome in outcomes:
            joined.sent += outcome.sent
            joined.nonfinite += outcome.nonfinite
            joined.malformed += outcome.malformed
            joined.demands.update(outcome.demands)
            joined.error = joined.error or outcome.error
            joined.writes += outcome.writes
        return joined
