"""Every registry name under SGD with momentum and under AdamW, for tests that train each once.

A worker calls :func:`each_family_and_name` with its training function; the results are keyed
``(family, name)``. :data:`OPTIONS` holds what a name needs beyond the one line to compress from
step 2 of a short run (with the hook's ``warmup_steps=2``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import gradsift

FAMILIES = ("sgd", "adamw")
OPTIONS: dict[str, dict[str, Any]] = {"threshold": {"threshold": 0.01}, "powersgd": {"start_iter": 2}}


def optimizer_for(family: str, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (``"sgd"``) or AdamW (``"adamw"``)."""
    if family == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3)


def each_family_and_name(
    train: Callable[[str, Any], Any], extra: tuple[Any, ...] = ()
) -> dict[tuple[str, Any], Any]:
    """``train(family, name)`` for every family and registry name (and each of ``extra``, such as
    None for stock DDP), its warnings ignored: a run's warnings are not what these tests judge."""
    results = {}
    for family in FAMILIES:
        for name in (*extra, *gradsift.available_compressors()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[family, name] = train(family, name)
    return results


def each_case(test: Callable[..., Any]) -> Callable[..., Any]:
    """``test`` parametrized by ``family`` and ``name``, the keys :func:`each_family_and_name` made."""
    by_name = pytest.mark.parametrize("name", gradsift.available_compressors())
    return pytest.mark.parametrize("family", FAMILIES)(by_name(test))
