"""Exchanges: one module per way of moving a bucket between the workers.

``EXCHANGES`` maps each name to ``"module:Class"`` (imported on first use). A
compressor declares the exchanges it can travel by (``Compressor.exchanges``, the
first being its default); the DDP hook's ``exchange=`` option picks one of them, or
``"auto"`` (the default): the compressor's first *exact* exchange (:attr:`Exchange.exact`:
every rank gets the mean of every worker's own selection -- the allgather, the allreduce,
the delegated exchange), its default when it has none. No compressor supports two exact
exchanges, so there is nothing to choose between per bucket. The balanced reduce-scatter
and the shared mask move ``O(k)`` bytes instead of the allgather's ``(W-1) k`` but deliver
an approximation of the mean that costs accuracy at equal steps, so ``"auto"`` never takes
them; ``exchange="balanced"`` or ``"shared-mask"`` still does. The two-stage compressed
allreduce (1-bit Adam's) codes the workers' mean again on its way back, so it is not exact
either: a name to ask for.

This module is the registry alone and imports no torch, so the command line can offer
the names without loading it: a new exchange is one module plus one line here.
"""

from __future__ import annotations

EXCHANGES: dict[str, str] = {
    "allreduce": "gradsift.exchanges.allreduce:Allreduce",
    "allgather": "gradsift.exchanges.allgather:Allgather",
    "delegated": "gradsift.exchanges.delegated:Delegated",
    "balanced": "gradsift.exchanges.balanced:Balanced",
    "shared-mask": "gradsift.exchanges.shared_mask:SharedMask",
    "two-stage": "gradsift.exchanges.two_stage:TwoStage",
}

AUTO = "auto"


def available_exchanges() -> list[str]:
    """Every exchange name, in a stable order."""
    return list(EXCHANGES)


__all__ = ["AUTO", "EXCHANGES", "available_exchanges"]
