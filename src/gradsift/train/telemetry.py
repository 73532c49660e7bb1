"""Per-step exchange statistics for the training loop, from the gradsift DDP hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

StepStats = Callable[[], dict[str, float]]


def install_exchange(
    ddp_model: torch.nn.parallel.DistributedDataParallel, compressor: str, options: dict[str, Any]
) -> StepStats:
    """Register the gradient exchange on ``ddp_model``; return a function giving the
    last step's ``compress_s``, ``communicate_s``, ``decompress_s``, ``bytes_sent``,
    ``dense_bytes`` and ``density``."""
    try:
        from gradsift.ddp import register_comm_hook
    except ImportError:
        # TEMPORARY while gradsift.ddp is being written: stock DDP for "none" only.
        if compressor != "none":
            raise
        dense = 4 * sum(p.numel() for p in ddp_model.parameters())
        fixed = {"compress_s": 0.0, "communicate_s": 0.0, "decompress_s": 0.0,
                 "bytes_sent": float(dense), "dense_bytes": float(dense), "density": 1.0}  # fmt: skip
        return lambda: dict(fixed)
    state = register_comm_hook(ddp_model, compressor, **options)
    return lambda: step_exchange_stats(state)


def step_exchange_stats(state: Any) -> dict[str, float]:
    """The hook's statistics of the last step, in seconds and bytes."""
    raise NotImplementedError("written once gradsift.ddp's stats() format is known")
