"""Allgather of fixed-size messages: every worker receives every other worker's message.

For payloads whose positions or scales differ between workers (sparsifiers, VGC, the
quantizers). One message per bucket holds the ``P`` parts' payloads (:mod:`wire`), at
the same size on every worker, so it travels in one ``all_gather_into_tensor`` that
overlaps the rest of backward, with no size exchange before it. When it arrives, each
worker's message is checked on the device (:meth:`wire.MessageLayout.unpack`) and
``decompress([p_1, ..., p_W])`` of each part is written into the result -- or, when the
context has a ``before_mean`` (:attr:`~gradsift.exchanges.base.Exchange.defers_mean`), after
it, once the step's close knows its flag; the non-finite flags in the headers and the
malformed-sender flags go to the :class:`~gradsift.core.parts.Outcome`.

Bytes: ``bytes_sent`` is what the entries in use and the headers take (the payloads'
``used_nbytes`` and the flag word), ``bytes_padded`` the whole fixed message (capacity,
alignment), ``bytes_received`` ``(W-1)`` times the message (every other worker's slot).
Per-worker traffic therefore grows with ``W``. :func:`gather_payloads` is the trip of
one message, which the balanced exchange reuses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradsift.core import wire
from gradsift.core.collectives import Pending, allgather
from gradsift.core.errors import InvalidOptionError
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload
from gradsift.exchanges.base import Codec, Exchange
from gradsift.exchanges.costmodel import Traffic, allgather_traffic

#: Bytes of the header's flag word, which every message sends.
FLAG_NBYTES = wire.HEADER_DTYPE.itemsize


class Allgather(Exchange):
    """One allgather of the bucket's fixed-size message (see the module docstring)."""

    name = "allgather"
    replicated = True
    copies_input = True
    defers_mean = True

    @classmethod
    def traffic(cls, k: int, world: int) -> Traffic:
        """A header allgather, then ``k`` entries from every worker (:func:`allgather_traffic`)."""
        return allgather_traffic(k, world)

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        sent, gathered = gather_payloads([codec.encode(part, context).wire for part in parts], context)

        def write_means(received: wire.Received) -> list[torch.Tensor]:
            flags = []
            for i, part in enumerate(parts):
                flag = codec.decompress_into(
                    [worker[i] for worker in received.payloads], part.view(context.result), context.record
                )
                if flag is not None:
                    flags.append(flag)
            return flags

        def finish(received: wire.Received) -> Outcome:
            before_mean = context.before_mean
            flags = [] if before_mean is not None else write_means(received)
            malformed = received.malformed
            if flags:
                malformed = malformed | torch.stack(flags).any()
            outcome = Outcome.of(
                parts,
                list(sent),
                nonfinite=received.nonfinite,
                malformed=malformed,
                demand=(received.demand, received.used),
            )
            if before_mean is not None:
                outcome.writes.append(lambda dropped: deferred(before_mean, received, dropped))
            return outcome

        def deferred(
            before_mean: Callable[[list[Payload], torch.Tensor | None], None],
            received: wire.Received,
            dropped: torch.Tensor | None,
        ) -> None:
            before_mean(list(sent), dropped)
            if write_means(received):
                raise InvalidOptionError(
                    f"{codec.compressor.name} checks its payloads while it decodes: its means cannot wait "
                    "for the step's flag (a context's before_mean is for compressors whose decode flags nothing)"
                )

        return gathered.then(finish)


def gather_payloads(
    payloads: list[Payload], context: Context
) -> tuple[list[Payload], Pending[wire.Received]]:
    """Pack ``payloads`` (wire form) into one message, allgather it, and unpack what arrives.

    The message is packed into this worker's own slot of the buffer the allgather fills
    (row ``rank`` of ``W`` messages: an in-place allgather), and the payloads come back as
    views of it (:meth:`wire.MessageLayout.packed`), so what a worker sends and what error
    feedback keeps of it take no memory beside the received buffer. Counts the bytes into
    ``context.record``; no host read."""
    layout = wire.MessageLayout(payloads)
    flags = [p.nonfinite for p in payloads if p.nonfinite is not None]
    nonfinite = None if not flags else torch.stack(flags).any()
    context.record.add_bytes(
        sent=sum_counts([p.used_nbytes() for p in payloads]) + FLAG_NBYTES,
        padded=layout.nbytes,
        received=(context.world - 1) * layout.nbytes,
    )
    out = torch.empty(context.world * layout.nbytes, dtype=torch.uint8, device=wire.device_of(payloads))
    mine = out.narrow(0, context.rank * layout.nbytes, layout.nbytes)
    message = layout.pack(payloads, nonfinite, into=mine)
    gathered = allgather(out, message, context.group, "message all_gather")
    received = gathered.then(lambda buffer: layout.unpack(buffer, context.world))
    return layout.packed(message, payloads), received


def sum_counts(counts: list[int | torch.Tensor]) -> int | torch.Tensor:
    """The sum of host ints and device scalars: a host int when every term is one."""
    hosts = sum(c for c in counts if not isinstance(c, torch.Tensor))
    devices = [c for c in counts if isinstance(c, torch.Tensor)]
    return hosts + torch.stack(devices).sum() if devices else hosts
