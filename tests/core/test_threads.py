"""gradsift.core.threads: waiting at exit until the process's other threads are idle (Linux /proc)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import pytest

from gradsift.core.threads import TASKS, running_threads, wait_until_idle

pytestmark = pytest.mark.skipif(not TASKS.exists(), reason="needs Linux /proc/self/task")


BLOCK = bytes(1 << 20)


def spinner(stop: threading.Event, seconds: float | None) -> threading.Thread:
    """A thread that keeps a CPU busy until ``stop`` or ``seconds``, mostly in C without the
    GIL (hashing a 1 MiB block), as a backend thread runs a destructor."""

    def spin() -> None:
        end = None if seconds is None else time.monotonic() + seconds
        while not stop.is_set() and (end is None or time.monotonic() < end):
            hashlib.sha256(BLOCK).digest()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    return thread


def test_a_blocked_thread_does_not_count_as_running():
    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait, daemon=True)
    sleeper.start()
    try:
        assert wait_until_idle(timeout_s=5.0)  # once it has started and blocked in wait()
        assert sleeper.is_alive() and sleeper.native_id not in running_threads()
    finally:
        stop.set()
        sleeper.join()


def test_the_wait_lasts_until_a_busy_thread_is_done():
    """A thread that needs the GIL gets it while the caller waits, and the wait ends only after it."""
    stop = threading.Event()
    busy = spinner(stop, seconds=0.3)
    assert wait_until_idle(timeout_s=10.0)
    assert not busy.is_alive()


def test_a_thread_that_never_sleeps_ends_the_wait_at_its_timeout():
    stop = threading.Event()
    busy = spinner(stop, seconds=None)
    try:
        started = time.monotonic()
        assert not wait_until_idle(timeout_s=0.2)
        assert time.monotonic() - started >= 0.2
        assert busy.is_alive()
    finally:
        stop.set()
        busy.join()


SCRIPT = """
import hashlib, sys, threading, time
import gradsift.core.collectives  # imported by every hook: registers the exit wait
def work():
    end, block = time.monotonic() + 0.2, bytes(1 << 20)
    while time.monotonic() < end:
        hashlib.sha256(block).digest()
    open(sys.argv[1], "w").write("done")
threading.Thread(target=work, daemon=True).start()
"""


@pytest.mark.slow
def test_a_script_that_returns_at_once_lets_a_busy_thread_finish(tmp_path):
    """Interpreter exit waits (gradsift's atexit) for a thread still running: without the wait
    the daemon thread would be stopped at finalization, before it writes its file."""
    marker = tmp_path / "done"
    subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], check=True, timeout=60)
    assert marker.read_text() == "done"
