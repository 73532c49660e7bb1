"""Helpers shared by the trainer's process tests: find a rank's PID, wait with a deadline."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

#: A tiny, fast `gradsift train` configuration (MLP on synthetic data, 2 workers).
TINY = ["--model", "mlp", "--synthetic", "--workers", "2", "--batch-size", "16", "--no-progress"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """PID of the worker with RANK=rank among the launcher's children."""
    for pid in _children(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def wait_for(predicate, timeout: float, what: str, process: subprocess.Popen | None = None):
    """Poll ``predicate`` until truthy; fail at ``timeout`` or as soon as ``process`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"process exited ({process.returncode}) before {what}: {process.stderr.read()[-2000:]}"
            )
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def holds_socket(pid: int) -> bool:
    """Whether process ``pid`` holds a socket (a rank that joined its process group does)."""
    try:
        return any(os.readlink(fd).startswith("socket:") for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def session_alive(session: int) -> bool:
    """Whether any process of the session (process group) ``session`` is alive."""
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return False
    return True
