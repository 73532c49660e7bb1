"""Exchanges: one module per way of moving a bucket between the workers.

``EXCHANGES`` maps each name to ``"module:Class"`` (imported on first use). A
compressor declares the exchanges it can travel by (``Compressor.exchanges``, the
first being its default); the DDP hook's ``exchange=`` option picks one of them, or
``"auto"`` (the default): per bucket, among the supported exchanges that are *exact*
(:attr:`Exchange.exact`: every rank gets the mean of every worker's own selection --
the allgather, the allreduce, the delegated exchange), the one :mod:`gradsift.costmodel`
predicts fastest for the bucket's ``n`` elements, the sparsifier's ``k = ratio n`` and
the ``W`` workers, on :data:`AUTO_LINK` (exchanges without a formula: the compressor's
order). The balanced reduce-scatter and the shared mask move ``O(k)`` bytes instead of
the allgather's ``(W-1) k`` but deliver an approximation of the mean that costs
accuracy at equal steps, so ``"auto"`` never picks them; ``exchange="balanced"`` or
``"shared-mask"`` still does. Every rank computes the same choice from the same numbers.
"""

from __future__ import annotations

import importlib

from gradsift.compressors.base import Compressor
from gradsift.errors import InvalidOptionError
from gradsift.exchanges.base import Codec, Context, Delivery, Encoded, Exchange, Part

EXCHANGES: dict[str, str] = {
    "allreduce": "gradsift.exchanges.allreduce:Allreduce",
    "allgather": "gradsift.exchanges.allgather:Allgather",
    "delegated": "gradsift.exchanges.delegated:Delegated",
    "balanced": "gradsift.exchanges.balanced:Balanced",
    "shared-mask": "gradsift.exchanges.shared_mask:SharedMask",
}

AUTO = "auto"

#: The link ``"auto"`` plans for: 10 Gbit/s (in bytes per second) and 50 us per message.
AUTO_LINK = (10e9 / 8, 50e-6)


def available_exchanges() -> list[str]:
    """Every exchange name, in a stable order."""
    return list(EXCHANGES)


def get_exchange(name: str) -> Exchange:
    """A new instance of the exchange registered under ``name``."""
    return exchange_class(name)()


def exchange_class(name: str) -> type[Exchange]:
    """The class registered under ``name`` (imported on first use)."""
    if name not in EXCHANGES:
        raise InvalidOptionError(f"exchange must be one of {', '.join([AUTO, *EXCHANGES])}; got {name!r}")
    module_name, class_name = EXCHANGES[name].split(":")
    cls: type[Exchange] = getattr(importlib.import_module(module_name), class_name)
    return cls


def exchange_for(compressor: Compressor, name: str = AUTO) -> Exchange:
    """The exchange ``compressor`` travels by: ``name``, or for ``"auto"`` its first exact one
    (its default when it supports no exact exchange).

    Raises :class:`InvalidOptionError` naming the supported ones when ``compressor``
    cannot travel by ``name``.
    """
    supported = compressor.exchanges
    if name == AUTO:
        return get_exchange(_auto_candidates(compressor)[0])
    exchange = get_exchange(name)
    if name not in supported:
        raise InvalidOptionError(
            f"compressor {compressor.name!r} cannot travel by exchange {name!r}; it supports: {', '.join(supported)}"
        )
    return exchange


def _auto_candidates(compressor: Compressor) -> list[str]:
    """The supported exchanges ``"auto"`` may pick: the exact ones, in the compressor's
    order (its default alone when none is exact)."""
    exact = [name for name in compressor.exchanges if exchange_class(name).exact]
    return exact or [compressor.exchanges[0]]


def choose_exchange(
    compressor: Compressor, numel: int, world: int, link: tuple[float, float] = AUTO_LINK
) -> str:
    """``"auto"``'s pick for one bucket: among the supported exact exchanges
    (:attr:`Exchange.exact`), the one with the least predicted time (ties and exchanges the
    cost model has no formula for: the compressor's order)."""
    from gradsift import costmodel
    from gradsift.compressors.base import target_count

    candidates = _auto_candidates(compressor)
    ratio = getattr(compressor, "ratio", None)
    if len(candidates) == 1 or ratio is None or world < 2:
        return candidates[0]
    k = target_count(numel, ratio)
    traffic = {"allgather": lambda: costmodel.allgather_traffic(k, world)}
    seconds = {name: float(traffic[name]().seconds(*link)) for name in candidates if name in traffic}
    return min(candidates, key=lambda name: (seconds.get(name, float("inf")), candidates.index(name)))


__all__ = [
    "AUTO",
    "EXCHANGES",
    "Codec",
    "Context",
    "Delivery",
    "Encoded",
    "Exchange",
    "Part",
    "available_exchanges",
    "choose_exchange",
    "exchange_class",
    "exchange_for",
    "get_exchange",
]
