"""Contended mode (``processes = N > 1``): ``N`` processes measure the same thing at the same time.

``N`` processes (each with the run's ``threads`` threads) run the same measurement at
the same time, meeting at a barrier before every group, so each one's timings are taken
while the other ``N - 1`` compete for the cores -- what ``N`` workers on one machine
look like. Rows then hold the median over all processes' samples (:func:`pooled`), and
each process's own median. A process that dies (an error, the OOM killer) fails the run
within about a second (:data:`POLL_S`); the others are stopped.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gradsift.core.errors import GradsiftError

T = TypeVar("T")

#: Longest wait for the next contended worker's result while every worker is alive (a hung
#: worker must not hang the run; one that dies fails it within :data:`POLL_S`).
CONTENDED_TIMEOUT_S = 3600
#: Seconds between two looks at the contended workers' exit codes while waiting for results.
POLL_S = 0.5


def in_processes(count: int, measure: Callable[..., T]) -> list[T]:
    """``measure(barrier=...)`` run in ``count`` concurrent spawned processes sharing one
    barrier (``measure`` must pickle); their results, by process id."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    workers = [context.Process(target=_worker, args=(measure, barrier, results)) for _ in range(count)]
    for worker in workers:
        worker.start()
    collected: dict[int, T] = {}
    try:
        _collect(workers, results, collected)
    finally:  # the others wait at the barrier for the dead one: stop them
        for worker in workers:
            worker.join(timeout=10 if len(collected) == len(workers) else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()
    return [collected[pid] for pid in sorted(collected)]


def _worker(measure: Callable[..., Any], barrier: Any, results: Any) -> None:
    """One process of the contended mode: measure everything, put ``(pid, result)`` on ``results``."""
    results.put((os.getpid(), measure(barrier=barrier)))


def _collect(workers: Sequence[Any], results: Any, collected: dict[int, Any]) -> None:
    """Fill ``collected`` with each worker's ``(pid, result)`` from ``results``.

    Never one long blocking ``get``: every :data:`POLL_S` seconds without a result, the
    workers' exit codes are read, and a worker that ended without sending its result
    (an error, a signal such as the OOM killer's) raises :class:`GradsiftError` at once.
    """
    waiting_since = time.monotonic()
    while len(collected) < len(workers):
        # read before the get: what a worker that has exited sent is already in the pipe
        ended = [worker for worker in workers if worker.exitcode is not None]
        try:
            pid, result = results.get(timeout=POLL_S)
        except queue.Empty:
            lost = [worker for worker in ended if worker.pid not in collected]
            if lost:
                raise GradsiftError(
                    "bench compress: contended worker(s) ended without sending their results: "
                    f"{_exits(workers, lost)} (a worker's traceback, if it raised, is on stderr above)"
                ) from None
            if time.monotonic() - waiting_since > CONTENDED_TIMEOUT_S:
                raise GradsiftError(
                    f"bench compress: no further contended result came in {CONTENDED_TIMEOUT_S} s "
                    f"({_exits(workers, workers)})"
                ) from None
            continue
        collected[pid] = result
        waiting_since = time.monotonic()


def exit_status(code: int | None) -> str:
    """A process's ``exitcode`` in words: ``running``, ``signal SIGKILL`` or ``exit code 1``."""
    if code is None:
        return "running"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _exits(workers: Sequence[Any], which: Sequence[Any]) -> str:
    """``worker 1 of 2 (pid 123): signal SIGKILL`` for each of ``which`` (``running`` while alive)."""
    described = []
    for worker in which:
        how = exit_status(worker.exitcode)
        described.append(f"worker {workers.index(worker)} of {len(workers)} (pid {worker.pid}): {how}")
    return ", ".join(described)


def pooled(per_process: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One group measured by several processes: the samples of all of them, concatenated,
    and each process's median ``compress`` time by label (``compress_ms_by_process``)."""
    first = per_process[0]
    samples = {
        label: {
            phase: [v for group in per_process for v in group["samples"][label][phase]] for phase in phases
        }
        for label, phases in first["samples"].items()
    }
    by_process = {
        label: [statistics.median(group["samples"][label]["compress"]) for group in per_process]
        for label in first["samples"]
    }
    return {**first, "samples": samples, "compress_ms_by_process": by_process}
