"""Start one worker process per rank on this machine, watch them, end the run cleanly.

Every rank is ``python -m gradsift.train.worker <out>/config.json`` with the
torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``) set
by a *network*: :class:`Localhost` here, or :class:`gradsift.train.netem.EmulatedNetwork`
which also prefixes the command with ``ip netns exec <namespace>``.

Rank 0 keeps the terminal (progress bar); rank ``r > 0`` writes ``<out>/logs/rank<r>.log``.
When any rank exits with an error, the others are terminated (then killed after a
grace period) and :class:`TrainingFailedError` reports the failing rank's error. On
Ctrl-C or SIGTERM the same cleanup runs before the exception propagates.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from gradsift.errors import GradsiftError
from gradsift.train.config import TrainConfig
from gradsift.train.worker import error_file

POLL_S = 0.1
GRACE_S = 10.0


class TrainingFailedError(GradsiftError, RuntimeError):
    """A worker process failed; the message names the rank and its error."""


class Network(Protocol):
    """Where and how each rank runs."""

    def command_prefix(self, rank: int) -> list[str]: ...

    def environment(self, rank: int) -> dict[str, str]: ...


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Localhost:
    """All ranks on the loopback interface, no emulation."""

    def __init__(self) -> None:
        self.port = free_port()

    def command_prefix(self, rank: int) -> list[str]:
        return []

    def environment(self, rank: int) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "GLOO_SOCKET_IFNAME": "lo"}


@contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks (cleanup) run."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Terminate every live process, kill the ones still alive after the grace period."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _failure_message(config: TrainConfig, failed: list[int], processes: list[subprocess.Popen]) -> str:
    """Describe the root failure: a rank killed by a signal first, else the earliest error file."""

    def order(rank: int) -> tuple[int, float]:
        path = error_file(config.out, rank)
        killed = processes[rank].returncode < 0
        return (0 if killed else 1, path.stat().st_mtime if path.exists() else float("inf"))

    rank = min(failed, key=order)
    code = processes[rank].returncode
    path = error_file(config.out, rank)
    if code < 0:
        detail = f"was killed by signal {signal.Signals(-code).name}"
    elif path.exists():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        detail = f"failed: {lines[-1] if lines else '(empty traceback)'} (traceback: {path})"
    else:
        detail = f"exited with status {code} (log: {Path(config.out) / 'logs' / f'rank{rank}.log'})"
    return f"rank {rank} of {len(processes)} {detail}"


def launch(config: TrainConfig, network: Network) -> dict[str, Any]:
    """Run ``config`` with one process per rank; return rank 0's summary."""
    out = Path(config.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in [*logs.glob("rank*.err"), out / "summary.json"]:
        stale.unlink(missing_ok=True)
    config_path = out / "config.json"
    config.save(config_path)
    processes: list[subprocess.Popen] = []
    log_files = []
    with _sigterm_as_exit():
        try:
            for rank in range(config.workers):
                env = {
                    **os.environ, **network.environment(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(config.workers), "LOCAL_WORLD_SIZE": str(config.workers),
                }  # fmt: skip
                command = [
                    *network.command_prefix(rank),
                    sys.executable,
                    "-m",
                    "gradsift.train.worker",
                    str(config_path),
                ]
                output = None
                if rank > 0:
                    output = open(logs / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
                    log_files.append(output)
                processes.append(subprocess.Popen(command, env=env, stdout=output, stderr=output))
            _watch(config, processes)
        finally:
            _stop(processes)
            for handle in log_files:
                handle.close()
    return json.loads((out / "summary.json").read_text())


def _watch(config: TrainConfig, processes: list[subprocess.Popen]) -> None:
    """Wait until every rank succeeded; raise as soon as one failed."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(POLL_S)  # let the first failure's error file land
            failed = [rank for rank, p in enumerate(processes) if p.poll() not in (None, 0)]
            raise TrainingFailedError(_failure_message(config, failed, processes))
        if all(code == 0 for code in codes):
            return
        time.sleep(POLL_S)


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` on this machine: over emulated links when ``config.bandwidth_bps``
    is set (see :mod:`gradsift.train.netem`), else on localhost."""
    if config.bandwidth_bps is None:
        return launch(config, Localhost())
    from gradsift.train.netem import EmulatedNetwork

    with EmulatedNetwork(config.workers, config.bandwidth_bps, config.latency_s) as network:
        return launch(config, network)


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
