"""The harnesses' worker processes: start them, take rank 0's result, and never wait on a dead one.

A harness that blocks on its result queue waits for as long as the queue's timeout when a
worker dies: the dead rank sends nothing, and its peers hang in their next collective.
:func:`run_ranks` polls the queue and the processes' exit codes together, so a worker that
dies (an exception, a signal, the OOM killer) fails the harness within seconds, its
surviving peers are stopped, and the error names the rank and carries its traceback.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from gradsift.tools.benchmarking import exit_status

#: Seconds between two looks at the result queue and at the workers' exit codes.
POLL_S = 0.25
#: Seconds a surviving worker gets to leave after a peer died, then again after SIGTERM.
GRACE_S = 2.0


class WorkersFailed(RuntimeError):
    """The workers exited, or ran out of time, without rank 0's result."""


def run_ranks(function: Callable[..., None], args: tuple[Any, ...], nprocs: int, *, timeout_s: float) -> Any:
    """Run ``function(rank, *args, results)`` in ``nprocs`` spawned processes; return the one
    object that a rank puts on the queue ``results``, once every worker has exited.

    Raises :class:`WorkersFailed` within about ``POLL_S + 2 * GRACE_S`` seconds of a worker
    exiting non-zero (naming every rank's exit code or signal, chained to torch's exception
    that carries the first failed worker's traceback), when they all exit cleanly without a
    result, or when ``timeout_s`` passes; the other workers are stopped first.
    """
    results = mp.get_context("spawn").Queue()
    workers = mp.start_processes(
        function, args=(*args, results), nprocs=nprocs, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout_s
    missing = object()
    result: Any = missing
    try:
        while True:
            if result is missing:  # before join: a worker cannot exit while its result is in the pipe
                with contextlib.suppress(queue.Empty):
                    result = results.get(timeout=POLL_S)
            try:  # raises at once when one exited non-zero, after stopping the others
                if workers.join(timeout=0 if result is missing else POLL_S, grace_period=GRACE_S):
                    break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                raise WorkersFailed(f"a worker died ({_exits(workers.processes)}): {error}") from error
            if time.monotonic() > deadline:
                raise WorkersFailed(f"the workers were still running after {timeout_s:g} s")
        if result is missing:
            try:  # the last worker's result may have reached the pipe just before it exited
                result = results.get(timeout=POLL_S)
            except queue.Empty:
                raise WorkersFailed("every worker exited cleanly, and none sent a result") from None
        return result
    finally:
        for process in workers.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _exits(processes: list[Any]) -> str:
    """``rank 0: signal SIGKILL, rank 1: exit code 1`` (a rank still running: ``running``)."""
    return ", ".join(
        f"rank {rank}: {exit_status(process.exitcode)}" for rank, process in enumerate(processes)
    )
