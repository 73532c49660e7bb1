"""``run_workers`` through the fork server keeps its contract: results come back, a crash
is reported with its exit code and every rank's output, a hang is killed at the timeout,
and each call gets fresh processes, a fresh process group and its own environment.

The workers are the functions at the top; ``run_workers`` loads this file in each rank.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

from support.distributed import fork_server, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def report_worker(rank: int, world: int, tensor: torch.Tensor) -> dict:
    """What a rank sees of its process, its group and its environment; the sum of ``tensor``."""
    total = tensor.clone()
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": total,
        "pid": os.getpid(),
        "parent": os.getppid(),
        "port": os.environ["MASTER_PORT"],
        "group_timeout": os.environ["GRADSIFT_TEST_GROUP_TIMEOUT"],
        "threads": torch.get_num_threads(),
        "random": random.random(),
        "cwd": os.getcwd(),
    }


def crash_worker(rank: int, world: int, how: str) -> None:
    """Rank 1 leaves the way ``how`` says, after printing a line; rank 0 returns. Both first
    meet at a barrier: a rank leaving while its peer is still inside
    ``init_process_group`` (gloo connecting its pairs) fails the peer's initialisation,
    which a loaded machine made visible (rank 0 exited 1, "connectFullMesh failed")."""
    dist.barrier()
    if rank == 1:
        print(f"rank 1 about to {how}", flush=True)
        if how == "exit":
            os._exit(3)
        if how == "abort":
            os.kill(os.getpid(), signal.SIGABRT)
        raise RuntimeError("a worker's exception")


def exit_handler_worker(rank: int, world: int) -> None:
    """Register an exit handler that ends the process with status 7 (as an abort at exit would
    end it abnormally): it runs only when the interpreter finalizes. The barrier keeps rank 0,
    which serves the group's store, alive until every rank has joined the group (without it
    rank 1 could still be building its gloo pairs when rank 0 exits: "Connection reset")."""
    dist.barrier()
    atexit.register(os._exit, 7)


def heap_worker(rank: int, world: int) -> dict:
    """How many objects of the heap are frozen here, and whether the hook's discovery finds an
    optimizer built in this rank (it walks ``gc.get_objects()``)."""
    import gc

    from gradsift.hook.discovery import find

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"frozen": gc.get_freeze_count(), "found": find(model.parameters(), scaler=False)[0] is optimizer}


def hang_worker(rank: int, world: int) -> None:
    print(f"rank {rank} hangs", flush=True)
    time.sleep(600)


def test_results_come_back_from_forked_ranks_twice_in_a_row(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    calls = [
        run_workers(__file__, "report_worker", 2, tensor=torch.arange(3.0), group_timeout=7) for _ in "ab"
    ]
    server = fork_server().process.pid
    for ranks in calls:
        assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
        assert all(torch.equal(r["sum"], torch.arange(3.0) * 2) for r in ranks)
        assert {r["parent"] for r in ranks} == {server}  # forks of the server, not fresh interpreters
        assert {(r["group_timeout"], r["threads"], r["cwd"]) for r in ranks} == {("7", 1, str(tmp_path))}
    first, second = calls
    assert first[0]["port"] != second[0]["port"]  # a fresh process group per call
    pids = [r["pid"] for ranks in calls for r in ranks]
    assert len(set(pids)) == 4 and server not in pids
    assert len({r["random"] for ranks in calls for r in ranks}) == 4  # reseeded like fresh processes


@pytest.mark.parametrize(("how", "code"), [("exit", 3), ("abort", -signal.SIGABRT), ("raise", 1)])
def test_a_crashed_rank_is_reported_with_its_exit_code_and_output(how: str, code: int) -> None:
    with pytest.raises(AssertionError) as failure:
        run_workers(__file__, "crash_worker", 2, how=how)
    report = str(failure.value)
    assert report.startswith(f"rank 1 exited with {code}\n")
    assert f"--- rank 1 (exit {code}) ---\nrank 1 about to {how}" in report
    assert "--- rank 0 (exit 0) ---" in report
    if how == "raise":
        assert "RuntimeError: a worker's exception" in report


def test_an_expected_exit_gives_none_for_that_rank() -> None:
    assert run_workers(__file__, "crash_worker", 2, how="exit", expect_exit={1: 3}) == [None, None]


def test_a_hang_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_workers(__file__, "hang_worker", 2, timeout=3)
    assert time.monotonic() - started < 30
    report = str(failure.value)
    assert report.startswith("workers did not finish within 3 s (killed)\n")
    for rank in range(2):
        assert f"--- rank {rank} (exit {-signal.SIGKILL}) ---\nrank {rank} hangs" in report


@pytest.mark.parametrize("launcher", ["forkserver", "subprocess"])
def test_finalize_ends_the_ranks_through_the_interpreters_exit(launcher: str, monkeypatch) -> None:
    """With ``finalize=True`` exit handlers run (so what goes wrong at exit is seen: status 7
    here); without it the ranks leave by ``os._exit(0)`` and never run them."""
    monkeypatch.setenv("GRADSIFT_TEST_WORKERS", launcher)
    assert run_workers(__file__, "exit_handler_worker", 2, finalize=True, expect_exit={0: 7, 1: 7}) == [
        None,
        None,
    ]
    assert run_workers(__file__, "exit_handler_worker", 2) == [None, None]


def test_the_preloaded_heap_is_frozen_and_a_finalizing_rank_unfreezes_it() -> None:
    """A rank's ``gc.get_objects()`` leaves out the server's preloaded heap, and still lists
    what the rank builds (the optimizer the hook discovers); a rank that exits through the
    interpreter's finalization walks the whole heap, as a fresh interpreter does."""
    for rank in run_workers(__file__, "heap_worker", 2):
        assert rank["frozen"] > 100_000 and rank["found"], rank
    for rank in run_workers(__file__, "heap_worker", 2, finalize=True):
        assert rank["frozen"] == 0 and rank["found"], rank


def test_the_subprocess_fallback_gives_the_same_results(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADSIFT_TEST_WORKERS", "subprocess")
    ranks = run_workers(__file__, "report_worker", 2, tensor=torch.ones(2))
    assert all(torch.equal(r["sum"], torch.full((2,), 2.0)) for r in ranks)
    assert all(r["parent"] == os.getpid() for r in ranks)  # started by this process, not the server
    assert {r["threads"] for r in ranks} == {1}


def test_an_unknown_launcher_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("GRADSIFT_TEST_WORKERS", "threads")
    with pytest.raises(ValueError, match="GRADSIFT_TEST_WORKERS='threads'"):
        run_workers(__file__, "report_worker", 2, tensor=torch.ones(1))
