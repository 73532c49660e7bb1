"""The exchange protocol: the one-way trip of a DDP bucket's parts between the workers.

The hook's layout builds one complete, frozen :class:`Context` per bucket and step (who
the workers are, where the means go, the state store, the step's readout, each part's
payload capacity); an exchange receives the bucket's *parts* (the whole bucket, or one
part per layer), each already compensated by error feedback, and a :class:`Codec` (the
compressor as an exchange sees it: encode a part into its wire payload, decode payloads
into a dense mean). It owns everything between the two: the collectives, the framing,
validation of what arrives, the byte counts (sent, padded, received) and the transport
of the non-finite flag, so that every rank learns together whether any rank's input
held NaN/Inf. It writes each part's mean over the workers into the bucket's result and
returns a :class:`Delivery` -- the only outcome of the trip: per part what this
worker's contribution stood for (error feedback keeps the rest), and as device flags
whether some input was non-finite and whether some sender's message was malformed, read
by the hook once, when the step closes. An exchange never reads a tensor on the host
and never knows which compressor it carries; dense parts travel through the same
protocol with the identity codec (:data:`IDENTITY`).

A new exchange is one module with one :class:`Exchange` subclass plus one line in
:data:`gradsift.exchanges.EXCHANGES`.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from gradsift.compressors.base import Compressor, Payload
from gradsift.compressors.dense import NoCompression
from gradsift.exchanges import wire
from gradsift.exchanges.collectives import Pending
from gradsift.readout import Readout
from gradsift.state import TensorStore
from gradsift.telemetry import BucketRecord

T = TypeVar("T")


@dataclass
class Part:
    """One exchanged piece of a bucket.

    Attributes:
        key: the state key (a parameter number, or the sorted tuple of a bucket's).
        offset: where the part starts in the bucket's flat gradient.
        flat: the local gradient of the part (a view into the bucket).
        params: the parameters it holds, in flattening order.
        compensated: the gradient with error feedback applied (``flat`` without it).
    """

    key: Hashable
    offset: int
    flat: torch.Tensor
    params: list[torch.nn.Parameter]
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
class Encoded:
    """A part as compressed: the local payload and the payload as sent.

    ``wire`` is also what error feedback subtracts: the values as they travelled (maybe
    rounded to ``value_dtype``) at their positions.
    """

    payload: Payload
    wire: Payload


@dataclass(frozen=True)
class Delivery:
    """What an exchange reports for its parts once the data arrived.

    Attributes:
        sent: per part, what this worker's contribution stands for -- a payload whose
            ``indices`` name the delivered positions, a dense tensor, or None when the
            part travelled uncompressed (all of it was sent: nothing is left over).
        nonfinite: 0-d bool device flag: some worker's input held NaN/Inf (the same on
            every rank); None when no worker's can have. The result is then garbage and
            the step is dropped.
        malformed: ``[W]`` bool device flags: worker ``w``'s message broke the format
            (the result is then garbage, but nothing was written out of range); None
            when the exchange receives nothing a peer could get wrong.
        demand: ``[P]`` device counts, per part the most entries any worker wanted to
            send (an adaptive-capacity compressor sizes its next payloads from them);
            None when the exchange does not report it.
        error: a failure the host already knows (a collective failed), raised when the
            step closes.
    """

    sent: list[Payload | torch.Tensor | None]
    nonfinite: torch.Tensor | None = None
    malformed: torch.Tensor | None = None
    demand: torch.Tensor | None = None
    error: BaseException | None = None


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


class Codec:
    """The compressor as an exchange sees it.

    Args:
        compressor: the compressor.
        value_dtype: dtype of sent values (None = the compressor's own).
        checks_values: whether a NaN/Inf carried by dense values must be detected on
            arrival (False for stock DDP's own exchange, where nothing could absorb it).
    """

    def __init__(
        self, compressor: Compressor, value_dtype: torch.dtype | None = None, checks_values: bool = True
    ) -> None:
        self.compressor = compressor
        self.value_dtype = value_dtype
        self.checks_values = checks_values

    def encode(self, part: Part, context: Context) -> Encoded:
        """Compress ``part.input`` into its wire payload (no host read).

        With a narrower ``value_dtype`` the sent values are checked for overflow on the
        device (``k`` values, not the ``n`` gradient elements): an Inf there flags the
        payload non-finite like a NaN in the input.
        """
        tensor = part.input
        extra = {"parameters": part.params} if self.compressor.needs_parameters else {}
        with context.record.timed("compress_ms", tensor.device):
            payload = self.compressor.encode(
                tensor,
                key=part.key,
                capacity=context.capacities.get(part.key),
                readout=context.readout,
                **extra,
            )
            sent = wire.to_wire(payload, self.value_dtype)
            if (
                sent.values is not payload.values
                and sent.values is not None
                and payload.nonfinite is not None
            ):
                sent = wire.flagged(sent, payload.nonfinite | ~torch.isfinite(sent.values.float().sum()))
        context.record.add("dense_tensors" if self.compressor.identity else "compressed_tensors", 1)
        context.record.add("elements_sent", payload.entries())
        return Encoded(payload, sent)

    def decompress_into(
        self, payloads: list[Payload], out: torch.Tensor, record: BucketRecord
    ) -> torch.Tensor | None:
        """The mean over the workers' payloads of one part, written into ``out``; the
        compressor's malformed flag (None: nothing it checks)."""
        with record.timed("decompress_ms", out.device):
            return self.compressor.decompress_into(payloads, out)


#: The codec of parts that travel as they are (dense): no copy, no flag of its own.
IDENTITY = Codec(NoCompression())


def waited(record: BucketRecord, pending: Pending[T], device: torch.device) -> T:
    """``pending.wait()``; the time spent waiting adds to ``record.communicate_ms`` (the
    communication that the rest of backward did not hide; decoding is timed apart)."""
    with record.timed("communicate_ms", device):
        return pending.wait()


class Exchange(abc.ABC):
    """One way of moving a bucket's parts between the workers (see the module docstring).

    A subclass sets ``name`` and implements :meth:`start`; a line in
    :data:`gradsift.exchanges.EXCHANGES` registers it, and a compressor travels by it
    when the compressor's ``exchanges`` name it (docs/extending.md writes one, end to end).

    Example::

        state = gradsift.register_comm_hook(model, "topk", ratio=0.01, exchange="balanced")
        state.exchange  # Balanced(): the sparse reduce-scatter, for every bucket
    """

    name: ClassVar[str]

    #: Whether every rank's result is the mean over the workers of what each worker's
    #: own compressor selected (``(1/W) sum_w decode(payload_w)``, up to the rounding of
    #: the sum): True for the allgather, the allreduce and the delegated exchange. False
    #: for an exchange that delivers an approximation of that mean and leaves the rest in
    #: error feedback, delaying it: the balanced reduce-scatter keeps only ``k`` of the up
    #: to ``W k`` summed positions, the shared mask sends every worker's values at one
    #: leader's positions only. Those cost accuracy at equal steps (measured at 8 and 16
    #: workers, issue 23), so ``exchange="auto"`` never picks them
    #: (:func:`gradsift.exchanges.choose_exchange`); they stay available by name.
    exact: ClassVar[bool] = True

    @abc.abstractmethod
    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Delivery]:
        """Start the exchange of ``parts``; waiting for the result writes every part's mean
        into ``context.result`` and gives the :class:`Delivery`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
