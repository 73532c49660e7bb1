"""A second device on a CPU-only machine, for tests of where tensors live.

NCCL reduces only CUDA tensors, and on a CPU-only machine a CPU tensor cannot pass for a
"GPU" one by accident. PyTorch's lazy-tensor backend (``torch._lazy``, TorchScript on the
CPU) gives a real non-CPU device whose tensors compute, copy to the CPU and -- like
tensors of a GPU the peer does not have -- do not pickle.
"""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def lazy_device() -> torch.device:
    """Start the lazy-tensor backend, once per process (a second ``init`` raises "Tried to register
    multiple backend fallbacks": two test modules in one worker process); its device."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy", 0)


def needs_lazy() -> None:
    pytest.importorskip("torch._lazy.ts_backend", reason="this torch has no lazy-tensor backend")


def tensors(value) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors(item)]
    return []
