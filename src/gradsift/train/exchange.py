"""The gradient exchange of the trainer: gradsift's DDP hook and its per-step numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

import gradsift

#: Keys of the per-step dict :func:`install_exchange`'s callable returns.
EXCHANGE_FIELDS = (
    "compress_s",
    "communicate_s",
    "decompress_s",
    "bytes_sent",
    "bytes_padded",
    "bytes_received",
    "dense_bytes",
    "density",
)


def install_exchange(
    ddp_model: DistributedDataParallel, compressor: str, options: dict[str, Any]
) -> Callable[[], dict[str, float]]:
    """Register ``gradsift.register_comm_hook(ddp_model, compressor, **options)``; return a
    function giving the last step's exchange numbers (:func:`step_exchange_stats`)."""
    state = gradsift.register_comm_hook(ddp_model, compressor, **options)
    return lambda: step_exchange_stats(state.stats()["step"])


def step_exchange_stats(step: dict[str, Any]) -> dict[str, float]:
    """The hook's last-step statistics in seconds and bytes.

    ``bytes_sent`` is this worker's message (data + headers); ``bytes_padded`` adds the
    padding an allgather sends to match the longest worker; ``bytes_received`` is what
    arrives at this worker under the collectives' bandwidth-optimal algorithms; ``dense_bytes`` is the
    uncompressed gradient. Phase times are the hook's host wall-clock sums over buckets
    (buckets overlap backward and each other).
    """
    return {
        "compress_s": step["compress_ms"] / 1e3,
        "communicate_s": step["communicate_ms"] / 1e3,
        "decompress_s": step["decompress_ms"] / 1e3,
        "bytes_sent": float(step["bytes_sent"]),
        "bytes_padded": float(step["bytes_padded"]),
        "bytes_received": float(step["bytes_received"]),
        "dense_bytes": float(step["dense_bytes"]),
        "density": float(step["density"]),
    }
