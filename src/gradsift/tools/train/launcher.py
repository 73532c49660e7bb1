"""Start a run's processes on this machine, watch them, end the run cleanly.

Two launchers, one supervision:

- ``local`` (default): one worker process per rank, ``python -m gradsift.tools.train.worker
  <out>/config.json`` (several runs' configs for :func:`run_trainings`, trained in turn by
  the same processes), with the torch.distributed environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``GLOO_SOCKET_IFNAME``) set here and by a *network*: :class:`Localhost`, or
  :class:`gradsift.tools.train.netem.EmulatedNetwork` (one emulated host per rank), which also
  prefixes the command with ``ip netns exec <namespace>``.
- ``torchrun``: one torchrun agent per emulated host (``--nodes`` hosts, ``workers /
  nodes`` ranks each), ``torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d
  --rdzv-endpoint <host 0>:29400 -m gradsift.tools.train.worker <out>/config.json``, exactly
  as on N real machines: the agents meet through the c10d rendezvous on host 0's
  address over the shaped links, torchrun sets the ranks' environment, and the worker
  code is the same. Host 0's agent hosts the rendezvous store (``is_host``), every agent
  announces its namespace address (``--local-addr``), so the ranks reach each other
  over the veths rather than through the machine's hostname.

The first process (rank 0, host 0's agent) keeps the terminal; the others write
``<out>/logs/rank<r>.log`` or ``<out>/logs/host<h>.log``. When any process exits with an
error or is killed, the others are terminated (then killed after a grace period),
the emulated network is deleted with everything still running inside it, and
:class:`TrainingFailedError` reports the root failure. On Ctrl-C or SIGTERM the same
cleanup runs before the exception propagates; a launcher killed outright (SIGKILL) takes
its processes with it (:mod:`~gradsift.tools.train.parent_guard`). After a run over an
emulated network ``<out>/network.json`` holds every host's link counters (bytes its NIC
received/sent).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gradsift.core.errors import GradsiftError, InvalidOptionError
from gradsift.core.validation import check_choice
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.parent_guard import guarded
from gradsift.tools.train.worker import error_file

POLL_S = 0.1
GRACE_S = 10.0
LAUNCHERS = ("local", "torchrun")
RENDEZVOUS_PORT = 29400
#: What one launch fixes for every run it trains (:func:`run_trainings`).
LAUNCH_FIELDS = ("workers", "device", "bandwidth_bps", "latency_s", "timeout_s")


class TrainingFailedError(GradsiftError, RuntimeError):
    """A worker process (or a torchrun agent) failed; the message names it and its error."""


class Network(Protocol):
    """Where and how each host's processes run."""

    def command_prefix(self, host: int) -> list[str]: ...

    def environment(self, host: int) -> dict[str, str]: ...

    def link_counters(self) -> list[dict[str, object]]: ...


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Localhost:
    """All ranks on the loopback interface, no emulation."""

    def __init__(self) -> None:
        self.port = free_port()

    def command_prefix(self, host: int) -> list[str]:
        return []

    def environment(self, host: int) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "GLOO_SOCKET_IFNAME": "lo"}

    def link_counters(self) -> list[dict[str, object]]:
        return []


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its name in error messages, command, environment, log file
    (None: the terminal)."""

    name: str
    command: list[str]
    env: dict[str, str]
    log: Path | None


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


def _earliest_worker_error(configs: list[TrainConfig]) -> tuple[int, Path] | None:
    """``(rank, traceback file)`` of the rank that failed first in any of the runs, if any
    rank left one."""
    written = [
        (path.stat().st_mtime, rank, path)
        for config in configs
        for rank in range(config.workers)
        if (path := error_file(config.out, rank)).exists()
    ]
    return min(written)[1:] if written else None


def _failure_message(
    configs: list[TrainConfig], failed: list[int], specs: list[ProcessSpec], processes: list[subprocess.Popen]
) -> str:
    """Describe the root failure: a process killed by a signal first, else the earliest
    worker traceback, else the first failed process's exit status."""
    killed = [index for index in failed if processes[index].returncode < 0]
    if killed:
        index = killed[0]
        return f"{specs[index].name} was killed by signal {signal.Signals(-processes[index].returncode).name}"
    error = _earliest_worker_error(configs)
    if error is not None:
        rank, path = error
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        last = lines[-1] if lines else "(empty traceback)"
        return f"rank {rank} of {configs[0].workers} failed: {last} (traceback: {path})"
    index = failed[0]
    log = specs[index].log
    return f"{specs[index].name} exited with status {processes[index].returncode}" + (
        f" (log: {log})" if log else ""
    )


def _prepare(config: TrainConfig) -> Path:
    """Create ``<out>/logs``, remove a previous run's error files and summary, save the
    config; return the config's path."""
    out = Path(config.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in [*logs.glob("rank*.err"), out / "summary.json", out / "network.json"]:
        stale.unlink(missing_ok=True)
    config_path = out / "config.json"
    config.save(config_path)
    return config_path


def _worker_command(config_paths: list[Path]) -> list[str]:
    return [sys.executable, "-m", "gradsift.tools.train.worker", *map(str, config_paths)]


def rank_processes(
    config: TrainConfig, network: Network, config_paths: list[Path], home: Path
) -> list[ProcessSpec]:
    """The local launcher: rank ``r`` on host ``r``, its environment set here, training the
    runs of ``config_paths`` in turn; the ranks above 0 write ``home/logs/rank<r>.log``."""
    specs = []
    for rank in range(config.workers):
        env = {**network.environment(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(config.workers), "LOCAL_WORLD_SIZE": str(config.workers)}  # fmt: skip
        log = home / "logs" / f"rank{rank}.log" if rank > 0 else None
        command = [*network.command_prefix(rank), *_worker_command(config_paths)]
        specs.append(ProcessSpec(f"rank {rank} of {config.workers}", command, env, log))
    return specs


def agent_processes(config: TrainConfig, network: Any, nodes: int, config_path: Path) -> list[ProcessSpec]:
    """The torchrun launcher: one agent per host of the emulated ``network``
    (:class:`~gradsift.tools.train.netem.EmulatedNetwork`), c10d rendezvous on host 0."""
    endpoint = f"{network.address(0)}:{RENDEZVOUS_PORT}"
    specs = []
    for host in range(nodes):
        command = [
            *network.command_prefix(host), sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc-per-node", str(config.workers // nodes),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", network.hub,
            "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}",
            "--local-addr", network.address(host), "--max-restarts", "0",
            "-m", "gradsift.tools.train.worker", str(config_path),
        ]  # fmt: skip
        env = {"GLOO_SOCKET_IFNAME": network.environment(host)["GLOO_SOCKET_IFNAME"]}
        log = Path(config.out) / "logs" / f"host{host}.log" if host > 0 else None
        specs.append(ProcessSpec(f"host {host} of {nodes} (torchrun agent)", command, env, log))
    return specs


def supervise(
    configs: list[TrainConfig], specs: list[ProcessSpec], network: Network, home: Path
) -> list[dict[str, Any]]:
    """Start ``specs``, which train ``configs``, each ending with this process
    (:mod:`~gradsift.tools.train.parent_guard`: a launcher killed leaves no rank behind); wait
    for all to succeed (or stop all at the first failure), write ``home/network.json`` from
    ``network``'s link counters; return rank 0's summary of each run."""
    processes: list[subprocess.Popen] = []
    log_files = []
    with _sigterm_as_exit():
        try:
            for spec in specs:
                output = None
                if spec.log is not None:
                    output = open(spec.log, "w")  # noqa: SIM115 - closed below
                    log_files.append(output)
                processes.append(
                    subprocess.Popen(
                        guarded(spec.command), env={**os.environ, **spec.env}, stdout=output, stderr=output
                    )
                )
            _watch(configs, specs, processes)
            counters = network.link_counters()
            if counters:
                (home / "network.json").write_text(json.dumps({"hosts": counters}, indent=2) + "\n")
        finally:
            _stop(processes)
            for handle in log_files:
                handle.close()
    return [json.loads((Path(config.out) / "summary.json").read_text()) for config in configs]


def _watch(configs: list[TrainConfig], specs: list[ProcessSpec], processes: list[subprocess.Popen]) -> None:
    """Wait until every process succeeded; raise as soon as one failed."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [index for index, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(POLL_S)  # let the first failure's error file land
            failed = [index for index, p in enumerate(processes) if p.poll() not in (None, 0)]
            raise TrainingFailedError(_failure_message(configs, failed, specs, processes))
        if all(code == 0 for code in codes):
            return
        time.sleep(POLL_S)


def emulated_hosts(config: TrainConfig, launcher: str, nodes: int | None) -> int:
    """Validate the launcher choice; return the number of emulated hosts it needs: one
    per rank for the local launcher, ``nodes`` (default: one per rank) for torchrun."""
    check_choice(launcher, "launcher", LAUNCHERS)
    if launcher == "local":
        if nodes is not None:
            raise InvalidOptionError(
                "nodes needs launcher torchrun (the local launcher puts one rank per host)"
            )
        return config.workers
    if config.bandwidth_bps is None:
        raise InvalidOptionError(
            "launcher torchrun starts one torchrun agent per emulated host and needs a bandwidth (--bandwidth); "
            "on one machine without emulation run `torchrun --standalone --nproc-per-node N -m gradsift train`"
        )
    nodes = config.workers if nodes is None else nodes
    if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= config.workers:
        raise InvalidOptionError(f"nodes must be an integer in [1, workers={config.workers}], got {nodes!r}")
    if config.workers % nodes:
        raise InvalidOptionError(f"workers ({config.workers}) must be a multiple of nodes ({nodes})")
    return nodes


def run_training(config: TrainConfig, *, launcher: str = "local", nodes: int | None = None) -> dict[str, Any]:
    """Run ``config`` on this machine: over emulated links when ``config.bandwidth_bps``
    is set (see :mod:`gradsift.tools.train.netem`), else on localhost. ``launcher="torchrun"``
    starts one torchrun agent in each of ``nodes`` emulated hosts instead of the ranks."""
    hosts = emulated_hosts(config, launcher, nodes)  # torchrun: over emulated links only
    if launcher == "local" or config.bandwidth_bps is None:
        return run_trainings([config], Path(config.out))[0]
    from gradsift.tools.train.netem import EmulatedNetwork

    # SIGTERM while the network is being built unwinds through its cleanup too.
    with _sigterm_as_exit(), EmulatedNetwork(hosts, config.bandwidth_bps, config.latency_s) as network:
        specs = agent_processes(config, network, hosts, _prepare(config))
        return supervise([config], specs, network, Path(config.out))[0]


def run_trainings(configs: list[TrainConfig], home: Path) -> list[dict[str, Any]]:
    """Run ``configs`` one after another in one launch of the local launcher: each rank's
    process trains them in turn in one process group, so a run after the first starts no
    interpreter, imports no torch and joins no group. The runs must agree on what a launch
    fixes (:data:`LAUNCH_FIELDS`); each keeps its own directory (config, records, summary, a
    failing rank's traceback), and the launch's ranks above 0 log to ``home/logs`` and its
    link counters go to ``home/network.json``. Returns rank 0's summary of each run."""
    first = configs[0]
    differing = [
        name for name in LAUNCH_FIELDS if any(getattr(c, name) != getattr(first, name) for c in configs)
    ]
    if differing:
        raise InvalidOptionError(f"the runs of one launch must agree on {', '.join(differing)}")
    (home / "logs").mkdir(parents=True, exist_ok=True)
    network: Any = nullcontext(Localhost())
    if (bandwidth := first.bandwidth_bps) is not None:
        from gradsift.tools.train.netem import EmulatedNetwork

        network = EmulatedNetwork(first.workers, bandwidth, first.latency_s)
    # SIGTERM while the network is being built unwinds through its cleanup too.
    with _sigterm_as_exit(), network as hosts:
        specs = rank_processes(first, hosts, [_prepare(config) for config in configs], home)
        return supervise(configs, specs, hosts, home)


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
