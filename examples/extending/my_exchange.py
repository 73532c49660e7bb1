"""Write your own exchange: each payload decoded by its sender, the means summed by one allreduce.

``DenseSum`` moves a bucket's parts as dense tensors. Worker ``w`` encodes each part
``p`` with the compressor, decodes its own payload back into the dense tensor it stands
for, ``d_wp`` (zero outside a sparsifier's selection), and one ``allreduce`` of the
concatenated ``d_wp / W`` gives every rank

    m_p = (1/W) sum_w d_wp,

which it writes into the part's slice of the bucket. That is exactly the mean of what
the workers sent, for any compressor, at the price of ``n`` values on the wire instead
of ``k``: a reference to check the other exchanges against, not a way to save bandwidth.

Run it (two gloo processes on this machine; rank 0 prints one JSON line)::

    python examples/extending/my_exchange.py
"""

from __future__ import annotations

from typing import Any

import torch
import toy
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.compressors.base import Compressor
from gradsift.core.collectives import Pending, allreduce_sum, ring_allreduce_received
from gradsift.core.parts import Context, Outcome, Part
from gradsift.exchanges import EXCHANGES
from gradsift.exchanges.base import Codec, Exchange
from gradsift.exchanges.delegated import DelegatingCompressor
from gradsift.hook.state import GradsiftHookState

NAME = "dense-sum"


class DenseSum(Exchange):
    """One allreduce of the dense tensors the workers' payloads stand for (module docstring)."""

    name = NAME

    @classmethod
    def carries(cls, compressor: Compressor) -> bool:
        """Every compressor that encodes payloads (each sender decodes its own): all but the
        ones that run their own collectives (PowerSGD)."""
        return not isinstance(compressor, DelegatingCompressor)

    def start(self, parts: list[Part], codec: Codec, context: Context) -> Pending[Outcome]:
        sent = [codec.encode(part, context).wire for part in parts]
        dense = [codec.compressor.sent_dense(payload).to(context.result.dtype) for payload in sent]
        message = torch.cat(dense).div_(context.world)
        flags = [payload.nonfinite for payload in sent if payload.nonfinite is not None]
        if flags:  # a NaN/Inf input that the payload does not carry: poison the message
            message.add_(torch.where(torch.stack(flags).any(), float("nan"), 0.0))
        nbytes = message.numel() * message.element_size()
        context.record.add_bytes(
            sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, context.world)
        )

        def finish(mean: torch.Tensor) -> Outcome:
            for part, piece in zip(parts, mean.split([part.numel for part in parts]), strict=True):
                part.view(context.result).copy_(piece)
            return Outcome.of(parts, list(sent), nonfinite=~torch.isfinite(mean.sum()))

        return allreduce_sum(message, context.group, f"{NAME} allreduce").then(finish)


# One line registers the exchange (EXCHANGES maps names to "module:Class", imported on first use).
EXCHANGES[NAME] = f"{DenseSum.__module__}:{DenseSum.__name__}"


def train(
    rank: int, steps: int = toy.STEPS, ratio: float = 0.1
) -> tuple[torch.nn.Module, GradsiftHookState, list[float]]:
    """``steps`` steps of SGD through top-k and ``dense-sum`` in the process group already set
    up: the trained model, the hook's state and this rank's losses."""
    ddp_model = DistributedDataParallel(toy.make_model())
    state = gradsift.register_comm_hook(ddp_model, "topk", ratio=ratio, exchange=NAME)
    losses = toy.sgd(ddp_model, rank, steps)
    return ddp_model.module, state, losses


def report(rank: int) -> dict[str, Any]:
    """What rank 0 prints: the exchange used, the first and last loss, the bytes sent."""
    _, state, losses = train(rank)
    total = state.stats()["total"]
    return {
        "exchange": type(state.exchange).__name__,
        "losses": [losses[0], losses[-1]],
        "bytes_sent": total["bytes_sent"],
        "dense_bytes": total["dense_bytes"],
    }


def main() -> None:
    toy.spawn(report)


if __name__ == "__main__":
    main()
