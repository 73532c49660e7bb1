"""What the tests' training loops and refusal checks share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """``loss.backward(); optimizer.step()``, or through ``scaler`` (scale, step, update) when given."""
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def refusal_messages(cases: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """Per case, the text of the :class:`InvalidOptionError` it raises, or ``"no error"``."""
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except InvalidOptionError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages
