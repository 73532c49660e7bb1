"""The exchange protocol: how the parts of one DDP bucket travel between the workers.

An exchange receives the bucket's *parts* (the whole bucket, or one part per layer),
each already compensated by error feedback, and a :class:`Codec` (the compressor as an
exchange sees it: encode a part into its wire payload, decode payloads into a dense
mean). It owns everything between the two: the collectives, the framing, validation
of what arrives, the byte counts (sent, padded, received) and the transport of the
non-finite flag, so that every rank learns together whether any rank's input held
NaN/Inf. It writes each part's mean over the workers into the bucket's result tensor
and reports, per part, what this worker's contribution stood for (error feedback
keeps the rest). An exchange never knows which compressor it carries.

A new exchange is one module with one :class:`Exchange` subclass plus one line in
:data:`gradsift.exchanges.EXCHANGES`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from gradsift.compressors.base import Compressor, Payload
from gradsift.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.exchanges import wire
from gradsift.exchanges.collectives import Pending
from gradsift.state import TensorStore
from gradsift.telemetry import BucketRecord
from gradsift.validation import all_finite

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


@dataclass
class Encoded:
    """A part as compressed: the local payload, the payload as sent, and the local flag.

    ``wire`` is also what error feedback subtracts: the values as they travelled (maybe
    rounded to ``value_dtype``) at their positions.
    """

    payload: Payload
    wire: Payload
    nonfinite: bool


def sparse_entries(payload: Payload, exchange: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload's ``(indices, values)``; :class:`InvalidOptionError` names the exchange otherwise."""
    if payload.indices is None or payload.values is None:
        raise InvalidOptionError(f"the {exchange} exchange carries (indices, values) payloads only")
    return payload.indices, payload.values


@dataclass
class Delivery:
    """What an exchange reports for its parts once the data arrived.

    Attributes:
        sent: per part, what this worker's contribution stands for -- a payload whose
            ``indices`` name the delivered positions, a dense tensor, or None when the
            part travelled uncompressed (all of it was sent: nothing is left over).
        nonfinite: some worker's input held NaN/Inf (the same on every rank); the
            result tensor is then not written and the step is dropped.
        error: a local failure found while decoding (a malformed message), raised by
            the hook when the step closes.
    """

    sent: list[Payload | torch.Tensor | None]
    nonfinite: bool = False
    error: BaseException | None = None


@dataclass
class Context:
    """What an exchange needs besides the parts.

    Attributes:
        group / world: the process group and its size.
        result: the bucket-sized tensor the parts' means are written into.
        record: the bucket's telemetry (bytes, phase times, the non-finite flag).
        bucket: the DDP ``GradBucket`` (the delegated exchange hands it to the compressor).
        key: the bucket's state key (the sorted tuple of its parameter numbers).
        order / numels: the bucket's parameter numbers in flat order, and each one's size.
        store: the hook's state store (exchanges that keep state put it there, under ``key``).
        step: the hook's step counter (the same on every rank).
        errors: failures found while the step's results are read, raised when it closes.
    """

    group: Any
    world: int
    result: torch.Tensor
    record: BucketRecord
    bucket: Any = None
    key: Hashable = None
    order: tuple[int, ...] = ()
    numels: Mapping[int, int] = field(default_factory=dict)
    store: TensorStore = field(default_factory=TensorStore)
    step: int = 0
    errors: list[BaseException] = field(default_factory=list)


class Codec:
    """The compressor as an exchange sees it.

    Args:
        compressor: the compressor.
        value_dtype: dtype of sent values (None = the compressor's own).
    """

    def __init__(self, compressor: Compressor, value_dtype: torch.dtype | None = None) -> None:
        self.compressor = compressor
        self.value_dtype = value_dtype

    def encode(self, part: Part, record: BucketRecord) -> Encoded:
        """Compress ``part.compensated`` into its wire payload; flag a non-finite input.

        A non-finite part is compressed again with NaN/Inf replaced by 0, so that the
        message keeps its layout (the hook drops the step on every rank and rolls its
        state back). With a narrower ``value_dtype`` the sent values are checked for
        overflow (``k`` values, not the ``n`` gradient elements).
        """
        started = time.perf_counter()
        tensor = part.input
        extra = {"parameters": part.params} if self.compressor.needs_parameters else {}
        nonfinite = False
        try:
            payload = self.compressor.compress(tensor, key=part.key, **extra)
        except NonFiniteGradientError:
            nonfinite = True
            cleaned = torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0)
            payload = self.compressor.compress(cleaned, key=part.key, **extra)
        sent = wire.to_wire(payload, self.value_dtype)
        narrowed = (
            sent.values is not None
            and payload.values is not None
            and sent.values.dtype != payload.values.dtype
        )
        if not nonfinite and narrowed and sent.values is not None:
            nonfinite = not all_finite(sent.values)  # a down-cast may overflow
        record.compressed_tensors += 1
        record.elements_sent += sent.count
        record.compress_ms += (time.perf_counter() - started) * 1e3
        return Encoded(payload, sent, nonfinite)

    def decompress(self, payloads: Sequence[Payload], numel: int, record: BucketRecord) -> torch.Tensor:
        """The mean over the workers' payloads of one part."""
        started = time.perf_counter()
        mean = self.compressor.decompress(payloads, numel)
        record.decompress_ms += (time.perf_counter() - started) * 1e3
        return mean

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor, record: BucketRecord) -> None:
        """The mean over the workers' payloads of one part, written into ``out`` in place."""
        started = time.perf_counter()
        self.compressor.decompress_into(payloads, out)
        record.decompress_ms += (time.perf_counter() - started) * 1e3


def waited(record: BucketRecord, pending: Pending[T]) -> T:
    """``pending.wait()``; the time spent waiting, less decoding, adds to ``record.communicate_ms``
    (the communication that the rest of backward did not hide)."""
    started, decoding = time.perf_counter(), record.decompress_ms
    try:
        return pending.wait()
    finally:
        record.communicate_ms += (time.perf_counter() - started) * 1e3 - (record.decompress_ms - decoding)


class Exchange(abc.ABC):
    """One way of moving a bucket's parts between the workers (see the module docstring)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def start(self, parts: list[Part], codec: Codec | None, context: Context) -> Pending[Delivery]:
        """Start the exchange of ``parts``; waiting for the result writes every part's mean
        into ``context.result`` (or reports a non-finite input).

        ``codec`` is None for parts that travel uncompressed (dense).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
