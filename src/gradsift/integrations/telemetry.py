"""Hook statistics as flat scalars, the shape every metrics logger accepts.

``state.stats()`` returns a (possibly nested) dict; loggers want ``name -> float``.
:func:`scalar_metrics` flattens nested dicts with ``/`` (``{"bytes": {"sent": 3}}`` ->
``{"gradsift/bytes/sent": 3.0}``), keeps ints, floats and one-element tensors, and drops
everything else (strings, lists, ``None``): those describe a run, they are not time series.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError


def scalar_metrics(stats: Mapping[str, Any], prefix: str = "gradsift") -> dict[str, float]:
    """Flatten ``stats`` into ``{prefix/key/subkey: float}``, keeping only finite numbers.

    Booleans become 0/1. Non-finite numbers (a ratio before the first step) are dropped
    rather than plotted as a spike.
    """
    if not isinstance(stats, Mapping):
        raise InvalidOptionError(f"stats must be a mapping (state.stats()), got {type(stats).__name__}")
    metrics: dict[str, float] = {}
    _flatten(stats, prefix, metrics)
    return metrics


def _flatten(stats: Mapping[str, Any], prefix: str, out: dict[str, float]) -> None:
    for key, value in stats.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            _flatten(value, name, out)
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, Real) and math.isfinite(float(value)):
            out[name] = float(value)
