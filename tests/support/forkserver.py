"""The fork server behind ``run_workers``: torch is imported once, and every rank is a fork.

A fresh interpreter spends seconds of CPU importing torch and gradsift before a test's
worker runs a single step, and ``run_workers`` starts two or three such interpreters per
call. This server is started once per pytest process (``support.distributed``), imports
:data:`PRELOAD`, and then forks the ranks of each call from that state: a rank starts in
milliseconds, runs :func:`support.distributed._worker_main` exactly as a fresh process
would, and ends with ``os._exit`` (or, when the call asks for it, through the
interpreter's finalization).

Protocol: one connection on the listening Unix socket per call, JSON lines.

- client -> server: ``{"path", "function", "world_size", "directory", "env", "cwd", "timeout"}``
- server -> client: ``{"pids": [...]}`` once every rank is forked, then
  ``{"exit_codes": [...], "timed_out": bool}`` once every rank has ended. Exit codes
  follow :mod:`subprocess`: a rank killed by a signal has ``-signal``.

Each rank writes its stdout and stderr to ``directory/rank<R>.log`` and gets the
request's environment, working directory and fresh random seeds. Ranks still alive
``timeout`` seconds after the fork, or when the client goes away, are killed.

Fork safety: a process that has started threads cannot be forked safely (the child gets
their locks, not the threads). The server sets one OpenMP thread before importing torch,
runs no torch operation, and refuses to fork when it has more than one thread; each rank
sets its own thread count (``_worker_main``).

The preloaded heap is frozen (:func:`gc.freeze`, as Python's documentation advises before
forking without exec): about 330,000 objects that no rank's garbage collection walks again
and that :func:`gc.get_objects` no longer lists. The hook's discovery
(gradsift.hook.discovery) walks ``gc.get_objects()`` twice at each registration's first
backward, 70-130 ms a walk over the preloaded heap, and the tests that register a hook for
every compressor on every rank paid it dozens of times per rank; what it looks for (an
optimizer, a scaler) is built in the rank, after the fork, so it still sees every candidate.
A rank that ends through the interpreter's finalization (``run_workers(..., finalize=True)``)
unfreezes the heap first: its exit walks what a fresh interpreter's exit walks.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

#: Imported once by the server, before any fork: what almost every worker needs.
#: ``torch._dynamo`` is what ``DistributedDataParallel``'s first construction imports
#: (about 800 modules, sympy among them: 2.4 s per rank; docs/decisions.md, "The test
#: suite's gloo workers are forks of one server per pytest process").
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "pytest",
    "gradsift",
    "gradsift.compressors.sidco",
    "support.distributed",
    "support.train",
)
#: The server checks this often (seconds) whether pytest, its parent, is still alive.
PARENT_POLL_S = 1.0


def thread_count() -> int:
    """The number of threads of this process (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/task"))


def main(listen_fd: int) -> None:
    """Preload, then serve launches on the inherited listening socket until pytest exits."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the preloaded heap: out of every rank's collections and gc.get_objects()
    listener = socket.socket(fileno=listen_fd)
    listener.settimeout(PARENT_POLL_S)
    parent = os.getppid()
    while os.getppid() == parent:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.setblocking(True)
        with connection:
            serve(connection, listener)


def serve(connection: socket.socket, listener: socket.socket) -> None:
    """One launch: fork the ranks, report their pids, reap them, report their exit codes."""
    stream = connection.makefile("rwb")
    request = json.loads(stream.readline())
    if thread_count() != 1:
        send(stream, {"error": f"the fork server has {thread_count()} threads; forking is unsafe"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pids = [fork_rank(request, rank, (connection, listener)) for rank in range(request["world_size"])]
    send(stream, {"pids": pids})
    exit_codes, timed_out = reap(pids, connection, request["timeout"])
    send(stream, {"exit_codes": exit_codes, "timed_out": timed_out})


def send(stream: Any, message: dict[str, Any]) -> None:
    try:
        stream.write(json.dumps(message).encode() + b"\n")
        stream.flush()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client is gone; reap() has already killed the ranks


def fork_rank(request: dict[str, Any], rank: int, inherited: tuple[socket.socket, ...]) -> int:
    """Fork one rank; in the child run it and never return.

    A rank ends with ``os._exit``, unless ``_worker_main`` returned (``run_workers(...,
    finalize=True)``): then ``SystemExit`` unwinds the server's frames and the child's
    interpreter finalizes as a script's does when it ends.
    """
    pid = os.fork()
    if pid:
        return pid
    code, finalize = 1, False
    try:
        for sock in inherited:
            os.close(sock.detach())  # the ranks must not hold the client's connection open
        become_fresh_process(request, rank)
        from support.distributed import _worker_main

        _worker_main(request["path"], request["function"], rank, request["world_size"], request["directory"])
        finalize = True
    except SystemExit as exit_:
        code = exit_code(exit_)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if not finalize:
            os._exit(code)
    raise SystemExit(0)


def become_fresh_process(request: dict[str, Any], rank: int) -> None:
    """What differs between a fork of the server and ``python tests/support/distributed.py``: output,
    environment, working directory, signal handlers, random seeds."""
    log = os.open(Path(request["directory"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    # A fresh interpreter ignores SIGPIPE (CPython's startup does): a write to a dead peer's
    # socket then fails with EPIPE, which gloo turns into an error the hook reports, instead
    # of killing the surviving rank (the dead-peer tests' rare exit -13).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    from support.distributed import FINALIZE_ENV

    if request["env"].get(FINALIZE_ENV) == "1":
        gc.unfreeze()  # it exits as a script does: its finalization walks the whole heap
    os.chdir(request["cwd"])
    sys.argv = [request["path"]]
    random.seed()
    import numpy

    numpy.random.seed()


def exit_code(exit_: SystemExit) -> int:
    """The status the interpreter would exit with after ``exit_``."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def reap(pids: list[int], connection: socket.socket, timeout: float) -> tuple[list[int], bool]:
    """Wait for every rank; kill all that remain at ``timeout`` or when the client hangs up."""
    pidfds = {os.pidfd_open(pid): rank for rank, pid in enumerate(pids)}
    exit_codes = [0] * len(pids)
    deadline, killed, timed_out = time.monotonic() + timeout, False, False
    while pidfds:
        if killed:
            ready, _, _ = select.select(list(pidfds), [], [])
        else:
            wait = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([*pidfds, connection], [], [], wait)
        if not killed and (connection in ready or not ready):
            timed_out = not ready
            for pidfd in pidfds:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            killed = True
        for pidfd in [fd for fd in ready if fd in pidfds]:
            rank = pidfds.pop(pidfd)
            exit_codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pids[rank], 0)[1])
            os.close(pidfd)
    return exit_codes, timed_out


if __name__ == "__main__":
    main(int(sys.argv[1]))
