"""Run a test function in real gloo worker processes on localhost.

``run_workers(path, "fn", world_size, **kwargs)`` starts ``world_size`` fresh Python
processes; each joins a gloo process group and calls ``fn(rank, world_size, **kwargs)``
from the file at ``path``, and whatever ``fn`` returns is sent back (``torch.save``).
Every run has a hard timeout: workers still alive after it are killed and the test
fails with their output, so a hung collective can never hang the test suite.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: Gloo's timeout inside the workers; failure tests rely on it being short.
GROUP_TIMEOUT_S = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(
    path: str | os.PathLike[str],
    function: str,
    world_size: int,
    *,
    timeout: float = 90.0,
    expect_exit: dict[int, int] | None = None,
    group_timeout: float = GROUP_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``function`` from ``path`` on ``world_size`` ranks; return the per-rank results.

    ``expect_exit`` maps ranks to the exit code they are expected to end with (a
    rank that dies on purpose); its result is then None.
    """
    expect_exit = expect_exit or {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(kwargs, Path(tmp, "kwargs.pt"))
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            "GRADSIFT_TEST_GROUP_TIMEOUT": str(group_timeout),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, os.fspath(path), function, str(rank), str(world_size), tmp],
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
        report = "\n".join(
            f"--- rank {r} (exit {p.returncode}) ---\n{o[-3000:]}"
            for r, (p, o) in enumerate(zip(procs, outputs, strict=True))
        )
        if timed_out:
            raise AssertionError(f"workers did not finish within {timeout} s (killed)\n{report}")
        for rank, proc in enumerate(procs):
            if proc.returncode != expect_exit.get(rank, 0):
                raise AssertionError(f"rank {rank} exited with {proc.returncode}\n{report}")
        return [
            None if rank in expect_exit else torch.load(Path(tmp, f"{rank}.pt"), weights_only=False)
            for rank in range(world_size)
        ]


def record_sparse_payloads(compressor: Any) -> dict:
    """Wrap ``compressor.compress`` so that every (indices, values, numel) it returns is
    kept, by key, in the returned dict (the payloads this rank really compressed)."""
    sent: dict = {}
    original = compressor.compress

    def recording(tensor: torch.Tensor, *, key: Any, **kwargs: Any) -> Any:
        payload = original(tensor, key=key, **kwargs)
        sent[key] = (payload.indices.clone(), payload.values.clone(), payload.numel)
        return payload

    compressor.compress = recording
    return sent


def _worker_main(path: str, function: str, rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_gradsift_test_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).parent))
    spec.loader.exec_module(module)
    timeout = float(os.environ.get("GRADSIFT_TEST_GROUP_TIMEOUT", GROUP_TIMEOUT_S))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
    )
    kwargs = torch.load(Path(tmp, "kwargs.pt"), weights_only=False)
    result = getattr(module, function)(rank, world_size, **kwargs)
    torch.save(result, Path(tmp, f"{rank}.pt"))
    # Exit without running gloo's C++ teardown: a rank whose peer has already torn its
    # pairs down can otherwise abort in a destructor ("terminate called without an
    # active exception") after its work is done. Tests whose group broke on purpose
    # cannot agree on a barrier first, so no rank waits for the others here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
