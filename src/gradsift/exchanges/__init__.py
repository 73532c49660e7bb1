"""Exchanges: one module per way of moving a bucket between the workers.

``EXCHANGES`` maps each name to ``"module:Class"`` (imported on first use). A
compressor declares the exchanges it can travel by (``Compressor.exchanges``, the
first being its default); the DDP hook's ``exchange=`` option picks one of them, or
``"auto"`` (the default), the compressor's default.
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
    "exchange_for",
    "get_exchange",
]
