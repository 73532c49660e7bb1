"""Exchanges: one module per way of moving a bucket between the workers.

``EXCHANGES`` maps each name to ``"module:Class"`` (imported on first use). A
compressor declares the exchanges it can travel by (``Compressor.exchanges``, the
first being its default); the DDP hook's ``exchange=`` option picks one of them, or
``"auto"`` (the default): per bucket, the supported exchange that
:mod:`gradsift.costmodel` predicts fastest for the bucket's ``n`` elements, the
sparsifier's ``k = ratio n`` and the ``W`` workers, on :data:`AUTO_LINK` (the hook
cannot see the network; the choice hardly depends on it: the allgather's ``(W-1) k``
bytes against the others' ``O(k)``, and their extra rounds, decide). Every rank
computes the same choice from the same numbers.
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
    if name not in EXCHANGES:
        raise InvalidOptionError(f"exchange must be one of {', '.join([AUTO, *EXCHANGES])}; got {name!r}")
    module_name, class_name = EXCHANGES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


def exchange_for(compressor: Compressor, name: str = AUTO) -> Exchange:
    """The exchange ``compressor`` travels by: ``name``, or its default for ``"auto"``.

    Raises :class:`InvalidOptionError` naming the supported ones when ``compressor``
    cannot travel by ``name``.
    """
    supported = compressor.exchanges
    if name == AUTO:
        return get_exchange(supported[0])
    exchange = get_exchange(name)
    if name not in supported:
        raise InvalidOptionError(
            f"compressor {compressor.name!r} cannot travel by exchange {name!r}; it supports: {', '.join(supported)}"
        )
    return exchange


def choose_exchange(
    compressor: Compressor, numel: int, world: int, link: tuple[float, float] = AUTO_LINK
) -> str:
    """``"auto"``'s pick for one bucket: the supported exchange with the least predicted time
    (ties and exchanges the cost model has no formula for: the compressor's default)."""
    from gradsift import costmodel
    from gradsift.compressors.base import target_count

    supported = compressor.exchanges
    ratio = getattr(compressor, "ratio", None)
    if len(supported) == 1 or ratio is None or world < 2:
        return supported[0]
    k = target_count(numel, ratio)
    traffic = {
        "allgather": lambda: costmodel.allgather_traffic(k, world),
        "balanced": lambda: costmodel.sparse_reduce_scatter_traffic(k, world),
        "shared-mask": lambda: costmodel.shared_mask_traffic(k, world),
    }
    seconds = {name: float(traffic[name]().seconds(*link)) for name in supported if name in traffic}
    return min(supported, key=lambda name: (seconds.get(name, float("inf")), supported.index(name)))


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
    "exchange_for",
    "get_exchange",
]
