"""``python -m gradsift.tools.train.parent_guard PID COMMAND [ARG ...]``: run COMMAND so that it
ends when process PID, the launcher that started it, ends.

The rule: Linux's ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` makes the kernel send this process SIGTERM
when its parent exits by any means (SIGKILL included: a scheduler's time limit, the OOM killer),
and the setting outlives ``execvp``, so COMMAND -- a training rank, or a torchrun agent, which
stops its ranks on SIGTERM -- keeps it under its own name and pid. A parent that exited before
the setting took shows as a parent pid other than PID: the guard then exits at once. Without
``prctl`` (not Linux) the guard only runs COMMAND. The signal follows the parent *thread* that
started the process; the launcher starts its processes from the thread that waits for them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1


def guarded(command: list[str]) -> list[str]:
    """``command`` run under the guard, ending with this process."""
    return [sys.executable, "-m", __name__, str(os.getpid()), *command]


def end_with_parent(parent: int) -> None:
    """Ask for SIGTERM when the parent exits; exit now when ``parent`` is no longer it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            sys.exit(f"parent_guard: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:
        sys.exit(f"parent_guard: the launcher (pid {parent}) has exited")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m gradsift.tools.train.parent_guard PID COMMAND [ARG ...]", file=sys.stderr)
        return 2
    end_with_parent(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
