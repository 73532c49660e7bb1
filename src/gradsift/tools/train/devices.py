"""Where a training run's ranks compute and which backend they talk over.

``cuda`` means one GPU per local rank (``LOCAL_RANK`` picks it) and NCCL; ``cpu`` means
the CPU and gloo. ``auto`` picks ``cuda`` on a machine with CUDA and ``cpu`` on one
without. A machine with CUDA but fewer GPUs than local ranks is refused rather than
silently trained on the CPU (``gradsift train`` measures; a run on another device is a
different measurement): :func:`fallback_device` is the explicit way to train on the
CPU there, which ``gradsift demo`` takes.
"""

from __future__ import annotations

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.validation import check_choice

#: What ``gradsift train --device`` and :attr:`TrainConfig.device` accept.
DEVICES = ("auto", "cpu", "cuda")


def gpus_suffice(local_workers: int) -> bool:
    """Whether this machine has CUDA and one GPU for each of ``local_workers`` ranks."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_workers


def resolve_device(requested: str, local_workers: int, count_name: str = "--workers") -> str:
    """``"cpu"`` or ``"cuda"`` for ``local_workers`` ranks on this machine, as ``requested``
    (one of :data:`DEVICES`); too few GPUs for ``cuda`` (or ``auto`` on a CUDA machine)
    raises an error naming ``count_name`` (the flag or variable that set the count)."""
    check_choice(requested, "device", DEVICES)
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise InvalidOptionError(
                "--device cuda needs CUDA, and torch.cuda.is_available() is False on this machine "
                "(--device cpu or auto trains on the CPU with gloo)"
            )
        return "cpu"
    count = torch.cuda.device_count()
    if count < local_workers:
        raise InvalidOptionError(
            f"{count_name} {local_workers} needs {local_workers} GPUs (one per rank with NCCL); this machine "
            f"has {count}: start at most {count} ranks per machine, or pass --device cpu to train on the "
            "CPU with gloo"
        )
    return "cuda"


def fallback_device(local_workers: int) -> tuple[str, str | None]:
    """``("cuda", None)`` when every local rank gets a GPU, else ``("cpu", note)``; the note
    (None on a machine without CUDA) says why a CUDA machine trains on the CPU."""
    if gpus_suffice(local_workers):
        return "cuda", None
    if not torch.cuda.is_available():
        return "cpu", None
    count = torch.cuda.device_count()
    return "cpu", (
        f"{count} GPU(s) for {local_workers} workers (NCCL needs one per rank): training on the CPU with gloo"
    )


def backend_for(device: str) -> str:
    """The process-group backend of a resolved device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"
