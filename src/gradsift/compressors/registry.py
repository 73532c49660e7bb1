"""Registry: compressor names -> classes, imported on first use.

The table maps each public name to ``"module:Class"`` so that importing gradsift
does not import every method (SciPy, the PowerSGD hook, ...). Registry names and
their options follow the papers (``ratio`` is the target density delta).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError, UnknownCompressorError
from gradsift.core.spelling import NAME_CLOSE, closest, did_you_mean

#: Registry name -> ``"module:Class"`` (imported on first use), or the class itself for one
#: added by :func:`register_compressor`.
_TABLE: dict[str, str | type[Compressor]] = {
    "none": "gradsift.compressors.casts:NoCompression",
    "fp16": "gradsift.compressors.casts:Float16",
    "bf16": "gradsift.compressors.casts:BFloat16",
    "topk": "gradsift.compressors.topk:TopK",
    "randomk": "gradsift.compressors.randomk:RandomK",
    "dgc": "gradsift.compressors.dgc:DGC",
    "redsync": "gradsift.compressors.redsync:RedSync",
    "gaussiank": "gradsift.compressors.gaussiank:GaussianK",
    "threshold": "gradsift.compressors.threshold:HardThreshold",
    "cocktail": "gradsift.compressors.cocktail:Cocktail",
    "sidco-exp": "gradsift.compressors.sidco:SIDCoExponential",
    "sidco-gpareto": "gradsift.compressors.sidco:SIDCoGeneralizedPareto",
    "sidco-gamma": "gradsift.compressors.sidco:SIDCoGamma",
    "vgc": "gradsift.compressors.vgc:VGC",
    "qsgd": "gradsift.compressors.qsgd:QSGD",
    "blockquant": "gradsift.compressors.blockquant:BlockQuantizer",
    "terngrad": "gradsift.compressors.terngrad:TernGrad",
    "signsgd": "gradsift.compressors.signsgd:SignSGD",
    "efsignsgd": "gradsift.compressors.signsgd:EFSignSGD",
    "onebit": "gradsift.compressors.signsgd:OneBit",
    "powersgd": "gradsift.compressors.powersgd:PowerSGD",
}


def register_compressor(name: str, cls: type[Compressor]) -> None:
    """Give the compressor class ``cls`` the registry name ``name``, so that
    ``get_compressor(name, **options)`` and ``register_comm_hook(ddp, name, **options)``
    build it (its keyword arguments are the options). A name already registered, or a
    class that is not a :class:`Compressor`, is refused."""
    if not isinstance(name, str) or not name:
        raise InvalidOptionError(f"a compressor's name must be a non-empty string, got {name!r}")
    if name in _TABLE or name == "auto":
        raise InvalidOptionError(f"compressor name {name!r} is taken; known compressors: {', '.join(_TABLE)}")
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise InvalidOptionError(f"register_compressor needs a Compressor subclass, got {cls!r}")
    _TABLE[name] = cls


def available_compressors() -> list[str]:
    """All registry names, in a stable order (dense, sparsifiers, quantizers, low rank)."""
    return list(_TABLE)


def compressor_class(name: str) -> type[Compressor]:
    """Return the class registered under ``name`` (imported on first use)."""
    if not isinstance(name, str) or name not in _TABLE:
        close = closest(name.lower(), _TABLE, NAME_CLOSE) if isinstance(name, str) else None
        raise UnknownCompressorError(
            f"unknown compressor {name!r}{did_you_mean([repr(close)] if close else [])}; "
            f"known compressors: {', '.join(_TABLE)}"
        )
    entry = _TABLE[name]
    if not isinstance(entry, str):
        return entry
    module_name, class_name = entry.split(":")
    cls: type[Compressor] = getattr(importlib.import_module(module_name), class_name)
    return cls


def compressor_options(name: str) -> list[str]:
    """The option names the compressor registered under ``name`` accepts (its keyword arguments)."""
    return [
        p.name
        for p in inspect.signature(compressor_class(name).__init__).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def unknown_options(name: str, options: Iterable[str]) -> list[str]:
    """The names in ``options`` that the compressor registered under ``name`` does not take, sorted."""
    return sorted(set(options) - set(compressor_options(name)))


def get_compressor(name: str, **options: Any) -> Compressor:
    """Build the compressor registered under ``name`` with the given options.

    Unknown option names raise :class:`InvalidOptionError` listing the accepted
    ones, and so does a missing option that has no default (``threshold``'s ``threshold``);
    out-of-range values raise from the compressor's own checks.
    """
    accepted = compressor_options(name)
    unknown = unknown_options(name, options)
    if unknown:
        hints = [match for option in unknown if (match := closest(option, accepted))]
        raise InvalidOptionError(
            f"compressor {name!r} has no option(s) {', '.join(unknown)}{did_you_mean(hints)}; "
            f"its options are: {', '.join(accepted) or '(none)'}"
        )
    parameters = inspect.signature(compressor_class(name).__init__).parameters
    missing = [n for n in accepted if parameters[n].default is inspect.Parameter.empty and n not in options]
    if missing:
        raise InvalidOptionError(
            f"compressor {name!r} needs {', '.join(f'{n}=' for n in missing)} (an option without a "
            f"default), e.g. get_compressor({name!r}, {missing[0]}=...) or "
            f"register_comm_hook(model, {name!r}, {missing[0]}=...)"
        )
    return compressor_class(name)(**options)
