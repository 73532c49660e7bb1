"""The timing protocol: interleaved rounds after warm-up calls, the median per method.

Every method is first called ``warmup`` times (adaptive methods settle their
per-tensor state; allocator and caches warm up), then the methods are called in turn,
``repeats`` rounds, so drift and background load hit them alike; round ``r`` starts at
the ``r``-th method (:func:`in_rotation`), so no method always follows the same one (a
short call's time depends on the call before it: docs/decisions.md). Reported: the median
over rounds.

What a time means: the wall clock (``time.perf_counter``) around one call. On CPU the
work runs in the calling process (on the run's ``threads`` threads), so that is its cost. On
CUDA the device is synchronised before and after the call (:func:`synchronizer`), so
the time covers the call's kernels as well as their launches: the device time one
bucket's encode adds to backward's stream (the hook itself never waits for it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def in_rotation(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` starting at position ``round_index mod len(items)``, wrapping around."""
    start = round_index % len(items) if items else 0
    return [*items[start:], *items[:start]]


def rounds(items: Sequence[T], repeats: int) -> Iterator[T]:
    """Each of ``items`` once per round, ``repeats`` rounds, round ``r`` :func:`in_rotation` by ``r``."""
    for round_index in range(repeats):
        yield from in_rotation(items, round_index)


def interleaved_medians_ms(
    methods: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    inner: int = 1,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median milliseconds per call of each method, timed round-robin so that drift hits all alike.

    Each method is called ``warmup`` times first; then ``repeats`` rounds time every
    method in turn (:func:`rounds`), ``inner`` calls per timing (resolution for
    microsecond calls), read on ``clock`` (seconds; the wall clock unless told otherwise).
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, fn in rounds(list(methods.items()), repeats):
        start = clock()
        for _ in range(inner):
            fn()
        times[name].append((clock() - start) * 1e3 / inner)
    return {name: statistics.median(samples) for name, samples in times.items()}


def synchronizer(device: str) -> Callable[[], None]:
    """What waits for ``device`` around a timed call: ``torch.cuda.synchronize`` on CUDA, nothing on CPU."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def timed_ms(fn: Callable[[], T], sync: Callable[[], None]) -> tuple[T, float]:
    """``fn()`` and its wall-clock milliseconds; ``sync()`` before the clock starts and before it stops."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - start) * 1e3
