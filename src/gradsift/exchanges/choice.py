"""Which exchange a compressor's buckets travel by: by name, or ``"auto"``: its first exact one.

An exchange name resolves through the registry (:data:`gradsift.exchanges.EXCHANGES`,
imported on first use); a compressor may travel by it when the exchange
:meth:`~gradsift.exchanges.base.Exchange.carries` it (by default: the compressor lists
the name in its ``exchanges``). ``"auto"`` takes the compressor's first exact exchange
(:mod:`gradsift.exchanges`'s docstring says why only exact ones).
"""

from __future__ import annotations

import importlib

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges import AUTO, EXCHANGES
from gradsift.exchanges.base import Exchange


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


def resolve_exchange(compressor: Compressor, name: str = AUTO) -> Exchange:
    """The exchange ``compressor`` travels by: ``name``, or for ``"auto"`` its first exact one
    (its default when it supports no exact exchange).

    Raises :class:`InvalidOptionError` naming the supported ones when ``compressor``
    cannot travel by ``name``.
    """
    if name == AUTO:
        return get_exchange(_auto_candidates(compressor)[0])
    exchange = get_exchange(name)
    if not exchange.carries(compressor):
        raise InvalidOptionError(
            f"compressor {compressor.name!r} cannot travel by exchange {name!r}; "
            f"it supports: {', '.join(compressor.exchanges)}"
        )
    return exchange


def _auto_candidates(compressor: Compressor) -> list[str]:
    """The supported exchanges ``"auto"`` may pick: the exact ones, in the compressor's
    order (its default alone when none is exact)."""
    exact = [name for name in compressor.exchanges if exchange_class(name).exact]
    return exact or [compressor.exchanges[0]]
