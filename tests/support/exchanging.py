"""What the tests of the optimizers whose step is the exchange share (``gradsift.DeMo``,
``gradsift.DistributedLion``): float64 parameters and gradients drawn from seeds, a run of
steps, a worker whose peer dies, and a resume from a checkpoint taken mid-run.

An optimizer is named by its ``gradsift`` attribute (``"DeMo"``) and built with keyword
``settings``, so that a rank started by :func:`support.distributed.run_workers` can build it
from its arguments.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import gradsift
from gradsift.core.errors import PeerFailureError
from support.distributed import run_workers

#: A matrix, a vector and a 3-D tensor: 97 elements, so a packed bit stream ends inside a byte.
SHAPES = [(6, 10), (7,), (2, 3, 5)]
#: The telemetry's times, which differ between two runs of the same steps.
PHASES = ("compress_ms", "communicate_ms", "decompress_ms")


def start(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64, generator=generator) for shape in SHAPES]


def gradients(rank: int, step: int) -> list[torch.Tensor]:
    return start(1000 + 100 * rank + step)


def trained(params: list[torch.nn.Parameter], optimizer: Any, rank: int, steps: range) -> None:
    """``steps`` steps of ``optimizer`` on rank ``rank``'s gradients of each step."""
    for step in steps:
        for param, grad in zip(params, gradients(rank, step), strict=True):
            param.grad = grad
        optimizer.step()


def dying_worker(rank: int, world: int, *, method: str, settings: dict[str, Any]) -> dict:
    """One step; then rank 1 exits and rank 0 tries two more: the error it got and how long
    it took to come."""
    params = [torch.nn.Parameter(p) for p in start(0)]
    optimizer = getattr(gradsift, method)(params, **settings)
    trained(params, optimizer, rank, range(1))
    if rank == 1:
        os._exit(3)
    began = time.monotonic()
    try:
        trained(params, optimizer, rank, range(1, 3))
    except PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - began}
    return {"error": None}


def poisoned(
    build: Callable[..., Any], value: float
) -> tuple[list[torch.nn.Parameter], Any, list[torch.Tensor]]:
    """Parameters, a fresh optimizer from ``build`` and a copy of the parameters, with the
    gradients of step 0 in place but one element ``value`` (a NaN or an Inf): no step taken yet."""
    params = [torch.nn.Parameter(p) for p in start(0)]
    optimizer = build(params)
    before = [p.detach().clone() for p in params]
    for param, grad in zip(params, gradients(0, 0), strict=True):
        param.grad = grad
    params[1].grad[3] = value
    return params, optimizer, before


def assert_a_dead_peer_raises(path: str, method: str, settings: dict[str, Any]) -> None:
    """Two ranks of the test module ``path`` run :func:`dying_worker` (which it imports):
    rank 0 gets :class:`PeerFailureError` from the all-gather within seconds, not a hang."""
    results = run_workers(
        path, "dying_worker", 2, group_timeout=10.0, timeout=60, expect_exit={1: 3},
        method=method, settings=settings,
    )  # fmt: skip
    assert results[0]["error"] is not None and f"{method} all-gather" in results[0]["error"]
    assert results[0]["seconds"] < 15


def assert_resumes_bit_for_bit(
    build: Callable[..., Any], other: dict[str, Any], steps: int, cut: int
) -> None:
    """``steps`` steps straight, against ``cut`` steps, a checkpoint through ``torch.save`` and
    ``torch.load``, an optimizer built with ``other`` groups' settings (the checkpoint's win)
    and the remaining steps: the parameters, every per-parameter state and the totals (but
    the times) are the same bit for bit."""
    params = [torch.nn.Parameter(p) for p in start(0)]
    straight = build(params)
    trained(params, straight, 0, range(steps))

    first_params = [torch.nn.Parameter(p) for p in start(0)]
    first = build(first_params)
    trained(first_params, first, 0, range(cut))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first_params], "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    second = build(resumed, **other)
    second.load_state_dict(saved["optimizer"])
    trained(resumed, second, 0, range(cut, steps))
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
        assert straight.state[a].keys() == second.state[b].keys()
        assert all(torch.equal(straight.state[a][name], second.state[b][name]) for name in straight.state[a])
    total = second.stats()["total"]
    assert total == straight.stats()["total"] | {name: total[name] for name in PHASES}
