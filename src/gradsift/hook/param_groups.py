"""The optimizer's parameter groups that hold the hooked model's parameters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def model_groups(
    optimizer: torch.optim.Optimizer, numbers: dict[int, int]
) -> Iterator[tuple[int, dict[str, Any], list[int]]]:
    """``(index, group, numbers)`` of every group of ``optimizer`` holding a parameter of the
    model, ``numbers`` (``id(parameter) -> number``) giving those parameters' numbers."""
    for index, group in enumerate(optimizer.param_groups):
        mine = [numbers[id(p)] for p in group["params"] if id(p) in numbers]
        if mine:
            yield index, group, mine
