"""Running PyTorch's own DDP communication hooks (PowerSGD's, the default allreduce) from gradsift.

:func:`collectives_done_on_return` makes their collectives complete before they return, so no
callback runs on a backend thread; :func:`batched_hook_runs` says whether the installed
PyTorch's batched PowerSGD hook can run at all. :mod:`gradsift.compressors.powersgd` uses both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_module

from gradsift.core.collectives import started


def batched_hook_runs() -> bool:
    """Whether the installed PyTorch's ``batched_powerSGD_hook`` can orthogonalize its ``Q``: it
    passes ``_orthogonalize`` one 2-D matrix, which PyTorch's batched orthogonalization (a 3-D
    batch of matrices) asserts against; probed on a 2 x 1 matrix."""
    try:
        powersgd_module._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


class _AllreduceDoneOnReturn:
    """``torch.distributed`` as PyTorch's hook modules see it inside :func:`collectives_done_on_return`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``dist.all_reduce``, waited for before it returns; its ``Work`` kept like every collective's."""
        work = dist.all_reduce(tensor, *args, **kwargs)
        if work is not None:  # async_op=True, what the hooks ask for
            started(work, None, kwargs.get("group"), "powersgd allreduce").wait()
        return work


@contextlib.contextmanager
def collectives_done_on_return() -> Iterator[None]:
    """Run PyTorch's PowerSGD and allreduce hooks with no Python left for gloo's threads.

    Those hooks chain their steps with ``work.get_future().then(callback)``; on a
    future still in flight the callback runs, and is destroyed, on the backend thread
    that completes the collective, which takes the GIL and can land in interpreter
    finalization when a script returns right after its last step: SIGABRT,
    "terminate called without an active exception" (docs/decisions.md, "Clean exit").
    Inside this context the hook modules' ``dist.all_reduce`` waits for the collective
    before it returns, so every ``then`` finds its future complete and runs the callback
    at once, on the calling (training) thread; the work handles are kept past exit by
    :data:`~gradsift.core.collectives.KEPT_WORKS`. The price: PowerSGD's first
    allreduce no longer overlaps the rest of backward (its later ones never did).
    """
    modules = (powersgd_module, default_hooks)
    originals = [vars(module)["dist"] for module in modules]
    for module in modules:
        vars(module)["dist"] = _AllreduceDoneOnReturn()
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            vars(module)["dist"] = original
