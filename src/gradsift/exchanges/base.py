"""The exchange protocol: the one-way trip of a DDP bucket's parts between the workers.

The hook builds one complete, frozen :class:`~gradsift.core.parts.Context` per bucket and step (who
the workers are, where the means go, the state store, the step's readout, each part's
payload capacity); an exchange receives the bucket's *parts* (the whole bucket, or one
part per layer), each already compensated by error feedback, and a :class:`Codec` (the
compressor as an exchange sees it: encode a part into its wire payload, decode payloads
into a dense mean). It owns everything between the two: the collectives, the framing,
validation of what arrives, the byte counts (sent, padded, received) and the transport
of the non-finite flag, so that every rank learns together whether any rank's input
held NaN/Inf. It writes each part's mean over the workers into the bucket's result and
returns an :class:`~gradsift.core.parts.Outcome` -- the only outcome of the trip: per part what this
worker's contribution stood for (error feedback keeps the rest), and as device flags
whether some input was non-finite and whether some sender's message was malformed, read
by the hook once, when the step closes. An exchange never reads a tensor on the host
and never knows which compressor it carries; dense parts travel through the same
protocol with the identity codec (:data:`IDENTITY`).

A new exchange is one module with one :class:`Exchange` subclass plus one line in
:data:`gradsift.exchanges.EXCHANGES`: what the hook needs to know of it, the exchange
declares (:attr:`Exchange.exact`, :attr:`Exchange.whole_bucket`, :meth:`Exchange.traffic`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from gradsift.compressors.base import Compressor
from gradsift.compressors.casts import NoCompression
from gradsift.core import wire
from gradsift.core.collectives import Pending, timing_waits
from gradsift.core.finite import nonfinite
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload
from gradsift.core.telemetry import BucketRecord
from gradsift.exchanges.costmodel import Traffic

T = TypeVar("T")


@dataclass(frozen=True)
class Encoded:
    """A part as compressed: the local payload and the payload as sent.

    ``wire`` is also what error feedback subtracts: the values as they travelled (maybe
    rounded to ``value_dtype``) at their positions.
    """

    payload: Payload
    wire: Payload


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

    def encode(self, part: Part, context: Context, counted: bool = True) -> Encoded:
        """Compress ``part.input`` into its wire payload (no host read); ``counted``: count it as
        one tensor sent (an exchange that codes a part in pieces counts the part once itself).

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
                sent = wire.flagged(sent, payload.nonfinite | nonfinite(sent.values))
        if counted:
            context.record.add_tensor(payload.entries(), dense=self.compressor.identity)
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


def wait_timed(record: BucketRecord, pending: Pending[T], device: torch.device) -> T:
    """``pending.wait()``; the time spent waiting for its collectives -- and only that: not the
    decoding and updates that run once they are done, timed as their own phases -- adds to
    ``record.communicate_ms`` (the communication that the rest of backward did not hide)."""
    with timing_waits(lambda: record.timed("communicate_ms", device)):
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
    #: workers, docs/decisions.md), so ``exchange="auto"`` never takes them
    #: (:func:`gradsift.exchanges.choice.resolve_exchange`); they stay available by name.
    exact: ClassVar[bool] = True

    #: Whether the exchange takes the whole bucket as one part and hands it to the
    #: compressor (which runs its own collectives: the delegated exchange), so the hook
    #: refuses ``granularity="layer"`` and frontends without DDP buckets refuse it.
    whole_bucket: ClassVar[bool] = False

    #: Whether every rank decodes every worker's payload itself, in rank order, so the
    #: mean is bit-identical on every rank (the allgather): what lets each rank apply a
    #: server stage to it alike (the hook option ``server_feedback``). An allreduce's sum
    #: is left to the backend, which does not promise the same bits on every rank.
    replicated: ClassVar[bool] = False

    #: Whether the exchange itself codes the workers' mean again with a server residual (1-bit
    #: Adam's second stage, inside the two-stage exchange), so the hook's ``server_feedback``
    #: would code it a second time and is refused.
    serves: ClassVar[bool] = False

    #: Whether :meth:`start` has read all it uses of each part's input before it returns (the
    #: payloads encoded and packed into the message; the means are written only when the
    #: trip finishes), so the hook may drop the input or let the bucket's own memory hold it:
    #: the allgather and the balanced exchange. The shared mask reads it again later.
    copies_input: ClassVar[bool] = False

    #: Whether the exchange honours a context's ``before_mean`` (:class:`~gradsift.core.parts.Context`):
    #: its trip then ends with the flags and the sent payloads only, and leaves the call and
    #: the means' writes to the outcome's ``writes``, which the step's close runs once every
    #: bucket's flags are in. The bucket's memory can then hold new state until the flag
    #: says whether to keep it: the allgather.
    defers_mean: ClassVar[bool] = False

    #: Whether the workers' messages add up on the way (each worker moves about one
    #: message's bytes, as in a ring allreduce) rather than each reaching every other
    #: worker (``W - 1`` messages, as in an allgather): the report's cost model uses it.
    reduces: ClassVar[bool] = False

    @classmethod
    def carries(cls, compressor: Compressor) -> bool:
        """Whether ``compressor``'s payloads can travel by this exchange; by default, when the
        compressor lists it in its ``exchanges`` (an exchange that can carry any payload,
        or one the compressors do not know of, says so here)."""
        return cls.name in compressor.exchanges

    @classmethod
    def traffic(cls, k: int, world: int) -> Traffic | None:
        """What one part of ``k`` selected entries costs on the wire among ``world``
        workers, for ``exchange="auto"``'s choice (:mod:`gradsift.exchanges.costmodel`);
        None (the default): no formula, the compressor's order decides."""
        del k, world
        return None

    @abc.abstractmethod
    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        """Start the exchange of ``parts``; waiting for the result writes every part's mean
        into ``context.result`` and gives the :class:`~gradsift.core.parts.Outcome`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
