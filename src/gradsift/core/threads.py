"""Wait, at interpreter exit, until the process's other threads are idle (Linux ``/proc``).

A gloo worker thread can still hold the last reference to a finished collective's
``Work`` when the script's main thread returns: a barrier's work keeps the works it
waited for, and drops them when the thread destroys it after the barrier completed.
Dropping one releases the Python-visible tensors it read or wrote, which takes the GIL;
once the interpreter finalizes, a thread that takes the GIL is ended by
``pthread_exit`` inside that C++ destructor and the process aborts (SIGABRT,
"terminate called without an active exception": docs/decisions.md, "Clean exit").
gradsift keeps its own collectives' works past exit (``KEPT_WORKS``); this covers the
ones a script starts itself, e.g. an ``all_gather`` and a ``barrier`` before it leaves.

:func:`wait_until_idle` sleeps (without the GIL, so a thread waiting for it gets it)
until every other thread of the process has been sleeping or blocked at
``quiet_polls`` polls in a row (the kernel's task state is not ``R``unning): a backend
thread that still has a destructor to run is runnable until it is done. It gives up
after ``timeout_s`` (a thread that never sleeps, e.g. a user's busy loop), and returns
at once where ``/proc/self/task`` does not exist.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

TASKS = Path("/proc/self/task")
RUNNING = "R"


def running_threads() -> list[int] | None:
    """Native ids of this process's threads other than the calling one that are running
    or runnable now; None where ``/proc/self/task`` is not available."""
    me = threading.get_native_id()
    try:
        tasks = list(TASKS.iterdir())
    except OSError:
        return None
    running = []
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        state = stat[stat.rindex(")") + 2]  # "tid (comm) S ...": comm may hold spaces and parentheses
        if state == RUNNING and int(task.name) != me:
            running.append(int(task.name))
    return running


def wait_until_idle(timeout_s: float = 0.5, poll_s: float = 0.002, quiet_polls: int = 2) -> bool:
    """Sleep until no other thread has run at ``quiet_polls`` polls in a row; at most ``timeout_s``.

    True when the process went quiet, False on timeout or without ``/proc``.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        running = running_threads()
        if running is None:
            return False
        quiet = 0 if running else quiet + 1
        if quiet >= quiet_polls:
            return True
        time.sleep(poll_s)
    return False
