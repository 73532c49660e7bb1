"""Two-stage compressed allreduce (1-bit Adam's): each worker's bytes do not grow with ``W``.

Tang et al. 2021's compressed allreduce, for codes that are deterministic and stateless
(:attr:`~gradsift.compressors.base.Compressor.server_stage`), which list it among their
``exchanges``: the sign codes and ``blockquant``.
Per part of ``n`` elements, taken in canonical order (the bucket's parameters by number,
:meth:`~gradsift.core.store.TensorStore.canonical`, so the chunks hold the same elements
whatever layout DDP hands in) and cut into ``W`` chunks of ``m = ceil(n / W)``, the last
padded with zeros (the padding's codes are dropped on the way back):

1. **scatter** -- worker ``k`` codes each chunk ``j`` of its input, ``C(x_k^j)``; one
   all-to-all hands worker ``j`` chunk ``j`` of every worker, and it decodes their mean
   ``s^j = (1/W) sum_k D(C(x_k^j))``;
2. **server stage** -- worker ``j`` alone codes its chunk's mean with a server residual
   ``e^j`` (zeros at first): ``t = s^j + e^j``, ``c^j = C(t)``, ``e^j <- t - D(c^j)``. The
   residual is kept in the state store under the part's key, as a tensor of ``n`` in the
   part's flat order that is zero outside this worker's chunk, so a bucket rebuild or a
   resume carries it like any residual, and a dropped step rolls it back;
3. **gather** -- one allgather of the ``c^j``; every worker decodes all ``W`` in rank order
   (the same bits on every rank: :attr:`replicated`) and lays the mean back into the part.

What worker ``k``'s contribution stands for, for its own error feedback, is
``D(C(x_k^j))`` over its chunks (a dense tensor in the part's layout). A worker's malformed
stage-1 message is known only to the chunk's owner, so the owner appends the ``W`` stage-1
sender flags to its stage-2 message, and every rank ORs what arrives: every rank then
knows the same senders. A NaN/Inf in a chunk rides in the headers of both stages.

Bytes per worker: sent and received ``W - 1`` chunk messages in each stage, about
``2 (W - 1) / W`` of one whole message of the part's code -- the share a ring allreduce
moves -- so a 1-bit code stays 32 times below fp32's ring allreduce at every ``W``, where
the allgather's received bytes grow as ``W - 1`` whole messages. Not :attr:`exact`: the
mean delivered is the server code of the workers' mean, the rest waits in ``e``, so
``exchange="auto"`` never takes it; name it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from gradsift.compressors.base import Compressor
from gradsift.core import wire
from gradsift.core.collectives import Pending, all_to_all, allgather
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload
from gradsift.core.store import Canonical, TensorStore
from gradsift.exchanges.allgather import FLAG_NBYTES, sum_counts
from gradsift.exchanges.base import Codec, Exchange

#: The store table of each worker's server residual (its chunk's, in the part's flat layout).
SERVER_CHUNK = "two_stage.server_residual"


class TwoStage(Exchange):
    """All-to-all of coded chunks, a server stage per chunk, allgather (module docstring)."""

    name = "two-stage"
    exact = False
    replicated = True
    reduces = True
    serves = True

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        world = context.world
        layouts = [_Chunked(part, context.store, world) for part in parts]
        chunks = [[Part((part.key, j), 0, chunk, part.params) for j, chunk in enumerate(c.chunks)]
                  for part, c in zip(parts, layouts, strict=True)]  # fmt: skip
        encoded = [[codec.encode(chunk, context, counted=False) for chunk in row] for row in chunks]
        for part in parts:  # one tensor of its own elements each, the padding not among them
            context.record.add_tensor(part.numel, dense=False)
        compressor = codec.compressor
        sent = [c.to_flat(torch.cat([compressor.sent_dense(e.wire).to(torch.float32) for e in row]))
                for c, row in zip(layouts, encoded, strict=True)]  # fmt: skip
        to_each = [[row[j].wire for row in encoded] for j in range(world)]
        first = wire.MessageLayout(to_each[0])
        messages = torch.stack([first.pack(payloads, _any_flag(payloads)) for payloads in to_each])
        others = [payloads for j, payloads in enumerate(to_each) if j != context.rank]
        context.record.add_bytes(
            sent=sum_counts([p.used_nbytes() for payloads in others for p in payloads])
            + FLAG_NBYTES * (world - 1),
            padded=(world - 1) * first.nbytes,
            received=(world - 1) * first.nbytes,
        )
        out = torch.empty_like(messages)
        scattered = all_to_all(out.view(-1), messages.view(-1), context.group, "two-stage all_to_all")

        def server_and_gather() -> Outcome:
            received = first.unpack(scattered.wait(), world)
            own, stage_one = [], received.malformed  # [W] sender flags, a decoder's flag on all
            for p, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
                mean = torch.empty(layout.size, dtype=torch.float32, device=part.flat.device)
                flag = codec.decompress_into(
                    [worker[p] for worker in received.payloads], mean, context.record
                )
                if flag is not None:
                    stage_one = stage_one | flag
                own.append(_server_stage(context, part.key, layout, mean, compressor))
            return _gather(parts, layouts, own, codec, context, received.nonfinite, stage_one, sent)

        return Pending(server_and_gather)


class _Chunked:
    """A part's elements in canonical order, cut into ``W`` chunks of ``m``; the last ones padded
    with zeros to ``m`` (only they are copied: the others are views)."""

    def __init__(self, part: Part, store: TensorStore, world: int) -> None:
        self.canonical: Canonical | None = store.canonical(part.key)
        self.numel, self.world = part.numel, world
        self.size = max(1, math.ceil(part.numel / world))
        ordered = self.ordered(part.input)
        self.chunks = [self.chunk(ordered, j) for j in range(world)]

    def ordered(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (the part's layout) in canonical order."""
        return flat if self.canonical is None else self.canonical.to_canonical(flat)

    def chunk(self, ordered: torch.Tensor, j: int) -> torch.Tensor:
        """Chunk ``j`` of the canonically ``ordered`` elements, zeros past the part's end."""
        piece = ordered[j * self.size : (j + 1) * self.size]
        return (
            piece
            if piece.numel() == self.size
            else torch.nn.functional.pad(piece, (0, self.size - piece.numel()))
        )

    def to_flat(self, padded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``W m`` chunks laid back into the part's layout (into ``out`` where given)."""
        ordered = padded[: self.numel]
        if self.canonical is not None:
            return self.canonical.to_flat(ordered, out=out)
        return ordered if out is None else out.copy_(ordered)


def _server_stage(
    context: Context, key: Hashable, layout: _Chunked, mean: torch.Tensor, compressor: Compressor
) -> Payload:
    """Step 2 on this worker's chunk of part ``key``: the payload of ``C(s + e)``, and
    ``e <- s + e - D(C(s + e))`` put new into the store (zero outside the chunk)."""
    residual = context.store.get(SERVER_CHUNK, key)
    rank = context.rank
    target = mean if residual is None else mean + layout.chunk(layout.ordered(residual), rank)
    payload = compressor.encode(target, key=(key, "server"), capacity=None, readout=context.readout)
    kept = torch.zeros(layout.numel, dtype=torch.float32, device=mean.device)  # canonical order
    lo, hi = min(rank * layout.size, layout.numel), min((rank + 1) * layout.size, layout.numel)
    kept[lo:hi] = (target - compressor.sent_dense(payload).to(torch.float32))[: hi - lo]
    context.store.put(SERVER_CHUNK, key, kept if layout.canonical is None else layout.canonical.to_flat(kept))
    return payload


def _gather(
    parts: list[Part],
    layouts: list[_Chunked],
    own: list[Payload],
    codec: Codec,
    context: Context,
    nonfinite: torch.Tensor,
    stage_one: torch.Tensor,
    sent: list[torch.Tensor],
) -> Outcome:
    """Step 3: allgather every worker's server payloads (with its stage-1 sender flags), decode
    all of them in rank order into the parts' views of the result; the outcome's flags."""
    world = context.world
    payloads = [wire.to_wire(p, codec.value_dtype) for p in own]
    layout = wire.MessageLayout(payloads)
    own_flag = _any_flag(payloads)
    flag = nonfinite if own_flag is None else nonfinite | own_flag
    message = torch.cat([layout.pack(payloads, flag), stage_one.to(torch.uint8)])
    context.record.add_bytes(
        sent=sum_counts([p.used_nbytes() for p in payloads]) + FLAG_NBYTES + world,
        padded=layout.nbytes + world,
        received=(world - 1) * (layout.nbytes + world),
    )
    out = torch.empty(world * message.numel(), dtype=torch.uint8, device=message.device)
    rows = allgather(out, message, context.group, "two-stage all_gather").wait().view(world, -1)
    received = layout.unpack(rows[:, : layout.nbytes].contiguous().view(-1), world)
    senders = rows[:, layout.nbytes :].to(torch.bool).any(dim=0)
    compressor = codec.compressor
    for p, (part, chunked) in enumerate(zip(parts, layouts, strict=True)):
        means = torch.cat(
            [compressor.sent_dense(worker[p]).to(torch.float32) for worker in received.payloads]
        )
        view = part.view(context.result)
        if view.dtype == torch.float32:
            chunked.to_flat(means, out=view)
        else:
            view.copy_(chunked.to_flat(means))
    return Outcome.of(parts, list(sent), nonfinite=received.nonfinite, malformed=received.malformed | senders)


def _any_flag(payloads: list[Payload]) -> torch.Tensor | None:
    """Whether any of ``payloads`` flags a non-finite input (None: none can tell)."""
    flags = [p.nonfinite for p in payloads if p.nonfinite is not None]
    return torch.stack(flags).any() if flags else None
