"""Run a test function in real gloo worker processes on localhost.

``run_workers(path, "fn", world_size, **kwargs)`` starts ``world_size`` processes; each
joins a gloo process group and calls ``fn(rank, world_size, **kwargs)`` from the file at
``path``, and whatever ``fn`` returns is sent back (``torch.save``). Every run has a hard
timeout: workers still alive after it are killed and the test fails with their output,
so a hung collective can never hang the test suite.

The processes are forks of one server per pytest process that has torch and gradsift
imported already (``tests/support/forkserver.py``): a launch costs milliseconds instead of an
interpreter start and torch's import per rank. ``GRADSIFT_TEST_WORKERS=subprocess``
starts every rank as a fresh ``python tests/support/distributed.py ...`` instead, as
before the server existed (for debugging a doubt about the server).
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from support import ROOT
from support.package import read_pyproject

#: Gloo's timeout inside the workers; failure tests rely on it being short.
GROUP_TIMEOUT_S = 20
#: How the ranks start (``GRADSIFT_TEST_WORKERS``): forks of the server, or fresh interpreters.
LAUNCHERS = ("forkserver", "subprocess")
#: The audit event of each call (tests/conftest.py checks that such a test is marked).
RUN_WORKERS_EVENT = "gradsift.tests.run_workers"
#: Set to "1" in a rank's environment when it must end through the interpreter's finalization.
FINALIZE_ENV = "GRADSIFT_TEST_FINALIZE"
#: Beyond a call's own timeout, how long the client waits for the server (its first start
#: imports torch) before it gives up on it.
SERVER_GRACE_S = 120.0


def with_test_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with pytest's ``pythonpath`` (pyproject.toml) first on ``PYTHONPATH``: the
    processes started here (the fork server, the ranks of the subprocess launcher) import a
    test module's ``support.<module>`` and the rest as the test process does."""
    configured = read_pyproject()["tool"]["pytest"]["ini_options"]["pythonpath"]
    folders = [str(ROOT / folder) for folder in configured]
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, (*folders, env.get("PYTHONPATH"))))}


#: Store ports: below the kernel's ephemeral range (32768+), one block per xdist worker, so
#: two workers' groups never draw the same port (a port the kernel hands out free to one
#: worker could be handed to the other before the first group's store listens on it).
PORT_BLOCK, PORT_BASE = 10_000, 2_000


def free_port() -> int:
    """A port no process listens on, from this xdist worker's own block."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = PORT_BASE + (worker % 3) * PORT_BLOCK
    while True:
        port = random.randrange(low, low + PORT_BLOCK)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@dataclass
class Launch:
    """How the ranks of one call ended: exit codes (``-signal`` if killed), their output."""

    exit_codes: list[int]
    outputs: list[str]
    timed_out: bool


def run_workers(
    path: str | os.PathLike[str],
    function: str,
    world_size: int,
    *,
    timeout: float = 90.0,
    expect_exit: dict[int, int] | None = None,
    group_timeout: float = GROUP_TIMEOUT_S,
    finalize: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``function`` from ``path`` on ``world_size`` ranks; return the per-rank results.

    ``expect_exit`` maps ranks to the exit code they are expected to end with (a
    rank that dies on purpose); its result is then None. With ``finalize`` a rank whose
    function returned ends as a user script does, through the interpreter's
    finalization (atexit handlers, module teardown), not ``os._exit(0)``: what a test of
    the exit itself needs (tests/project/test_clean_exit.py).
    """
    expect_exit = expect_exit or {}
    sys.audit(RUN_WORKERS_EVENT, os.fspath(path), function)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(kwargs, Path(tmp, "kwargs.pt"))
        env = {
            **with_test_path(dict(os.environ)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            "GRADSIFT_TEST_GROUP_TIMEOUT": str(group_timeout),
            FINALIZE_ENV: "1" if finalize else "0",
        }
        launch = launcher()(os.fspath(path), function, world_size, tmp, env, timeout)
        report = "\n".join(
            f"--- rank {r} (exit {code}) ---\n{output[-3000:]}"
            for r, (code, output) in enumerate(zip(launch.exit_codes, launch.outputs, strict=True))
        )
        if launch.timed_out:
            raise AssertionError(f"workers did not finish within {timeout} s (killed)\n{report}")
        for rank, code in enumerate(launch.exit_codes):
            if code != expect_exit.get(rank, 0):
                raise AssertionError(f"rank {rank} exited with {code}\n{report}")
        return [
            None if rank in expect_exit else torch.load(Path(tmp, f"{rank}.pt"), weights_only=False)
            for rank in range(world_size)
        ]


def launcher() -> Callable[..., Launch]:
    """The launch function ``GRADSIFT_TEST_WORKERS`` names (default: the fork server)."""
    name = os.environ.get("GRADSIFT_TEST_WORKERS", LAUNCHERS[0])
    if name not in LAUNCHERS:
        raise ValueError(f"GRADSIFT_TEST_WORKERS={name!r}: expected one of {LAUNCHERS}")
    return launch_forked if name == "forkserver" else launch_subprocesses


def launch_subprocesses(
    path: str, function: str, world_size: int, tmp: str, env: dict[str, str], timeout: float
) -> Launch:
    """Each rank a fresh interpreter running this file."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, path, function, str(rank), str(world_size), tmp],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs, timed_out = [], False
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in procs:
                other.kill()
            outputs.append(proc.communicate()[0])
    return Launch([proc.returncode for proc in procs], outputs, timed_out)


def launch_forked(
    path: str, function: str, world_size: int, tmp: str, env: dict[str, str], timeout: float
) -> Launch:
    """Each rank a fork of this pytest process's fork server."""
    request = {
        "path": path,
        "function": function,
        "world_size": world_size,
        "directory": tmp,
        "env": env,
        "cwd": os.getcwd(),
        "timeout": timeout,
    }
    reply = fork_server().launch(request, timeout + SERVER_GRACE_S)
    logs = [Path(tmp, f"rank{rank}.log") for rank in range(world_size)]
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    return Launch(reply["exit_codes"], outputs, reply["timed_out"])


class ForkServer:
    """The client's handle on one ``tests/support/forkserver.py`` process."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="gradsift-forkserver-"))
        self.address = str(self.directory / "socket")
        self.log = self.directory / "server.log"
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(self.address)
            listener.listen(8)
            with self.log.open("wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("forkserver.py")), str(listener.fileno())],
                    pass_fds=(listener.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**with_test_path(dict(os.environ)), "OMP_NUM_THREADS": "1"},
                )

    def launch(self, request: dict[str, Any], patience: float) -> dict[str, Any]:
        """Send one launch request; return the server's final reply (exit codes)."""
        with socket.socket(socket.AF_UNIX) as connection:
            connection.settimeout(patience)
            try:
                connection.connect(self.address)
                stream = connection.makefile("rwb")
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                replies = [json.loads(line) for line in (stream.readline(), stream.readline()) if line]
            except OSError as error:  # TimeoutError included
                raise AssertionError(f"the fork server failed ({error!r})\n{self.describe()}") from error
        if len(replies) != 2 or "exit_codes" not in replies[1]:
            raise AssertionError(f"the fork server answered {replies}\n{self.describe()}")
        return replies[1]

    def describe(self) -> str:
        """Whether the server still runs, and the end of its log (its own errors)."""
        state = "running" if self.process.poll() is None else f"exited with {self.process.returncode}"
        return f"fork server {state}; its log:\n{self.log.read_text(errors='replace')[-3000:]}"

    def close(self) -> None:
        """Stop the server (ranks still running end on their own timeouts) and remove its files."""
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


_SERVER: list[ForkServer] = []


def fork_server() -> ForkServer:
    """This process's fork server, started on first use and stopped at exit."""
    if not _SERVER:
        _SERVER.append(ForkServer())
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


def record_sparse_payloads(compressor: Any) -> dict:
    """Wrap ``compressor.encode`` (what the DDP hook calls) so that every (indices, values,
    numel) it returns -- the entries in use of its fixed-capacity payload -- is kept, by
    key, in the returned dict (the payloads this rank really compressed)."""
    sent: dict = {}
    original = compressor.encode

    def recording(tensor: torch.Tensor, *, key: Any, **kwargs: Any) -> Any:
        payload = original(tensor, key=key, **kwargs)
        used = payload.trimmed()
        sent[key] = (used.indices.clone(), used.values.clone(), payload.numel)
        return payload

    compressor.encode = recording
    return sent


def _worker_main(path: str, function: str, rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_gradsift_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timeout = float(os.environ.get("GRADSIFT_TEST_GROUP_TIMEOUT", GROUP_TIMEOUT_S))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
    )
    kwargs = torch.load(Path(tmp, "kwargs.pt"), weights_only=False)
    result = getattr(module, function)(rank, world_size, **kwargs)
    torch.save(result, Path(tmp, f"{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(FINALIZE_ENV) == "1":
        return  # the caller lets the interpreter finalize, as at the end of a script
    # Exit without running gloo's C++ teardown: a rank whose peer has already torn its
    # pairs down can otherwise abort in a destructor ("terminate called without an
    # active exception") after its work is done. Tests whose group broke on purpose
    # cannot agree on a barrier first, so no rank waits for the others here.
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
