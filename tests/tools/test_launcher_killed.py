"""``gradsift train`` killed outright leaves no rank behind.

A scheduler's time limit, the OOM killer or ``kill -9`` ends the launcher with SIGKILL, which
it cannot catch; its ranks must not train on, unseen, writing into the run directory (before
the parent guard, a one-worker run of ``--epochs 1e30`` killed so went on for half an hour).
The oracle is the kernel's process table: every rank has exited within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.train import TINY, holds_socket, rank_pid, running, session_alive, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_end_within_seconds_when_the_launcher_is_killed(tmp_path: Path) -> None:
    run = [*TINY, "--steps", "100000", "--out", str(tmp_path / "run")]
    launcher = subprocess.Popen([sys.executable, "-m", "gradsift", "train", *run], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        ranks = [wait_for(lambda r=r: (pid := rank_pid(launcher.pid, r)) is not None and holds_socket(pid) and pid, 120,
                          f"rank {r} to join", launcher) for r in range(2)]  # fmt: skip
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(map(running, ranks)), 10, "the ranks to end with their launcher")
    finally:
        if session_alive(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_the_guard_exits_when_its_launcher_has_already_gone() -> None:
    """A parent pid other than the one named: the launcher exited before the guard ran."""
    done = subprocess.run(
        [sys.executable, "-m", "gradsift.tools.train.parent_guard", "1", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "ran" not in done.stdout
    assert "the launcher (pid 1) has exited" in done.stderr
