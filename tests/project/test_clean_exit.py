"""A plain user script with the hook exits cleanly, and no hook Python runs on a backend thread.

The exit race (docs/decisions.md, "Clean exit") needs a gloo thread that still has
Python work when the interpreter finalizes, so one run rarely catches it; the
committed 200-run stress result is in results/exit/. Here the user script's training
runs :data:`EXIT_RUNS` times per compressor, interleaved, in forked ranks that end
through the interpreter's finalization as the script does (``run_workers(...,
finalize=True)``: about 5 CPU-s a run against 15 for two fresh interpreters). The worker
test below checks the property that closes the race, deterministically: during training
the hook attaches no Python callback to a collective still in flight, and decodes on
the thread that runs backward.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support import ROOT
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = ROOT / "scripts"


def load_script(name: str):
    """``scripts/NAME.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_stress_module():
    return load_script("exit_stress")


def user_script_worker(rank: int, world: int, compressor: str, steps: int) -> None:
    """scripts/exit_user_script.py once the group is joined: train, ``destroy_process_group()``
    with the model alive, return; ``run_workers(finalize=True)`` then lets the interpreter
    finalize, where an unclean exit shows."""
    _trained = load_script("exit_user_script").train(compressor, steps)
    dist.destroy_process_group()


COMPRESSORS = ["sidco-exp", "fp16", "vgc", "powersgd"]
#: Runs per compressor. A finalizing run costs about 2.3 CPU-s per rank (measured: a forked
#: rank's finalization with torch and torch._dynamo loaded); 3 x 4 runs cost about what
#: the 4 fresh-interpreter runs of this test's first version did.
EXIT_RUNS = 3


def test_plain_script_exits_cleanly_run_after_run():
    """Every run of every compressor ends with status 0 on both ranks (an abort at exit is
    -6 with "terminate called" in the rank's output; a hang is killed at the timeout)."""
    failures = {}
    for run in range(EXIT_RUNS):
        for compressor in COMPRESSORS:
            try:
                run_workers(__file__, "user_script_worker", 2, finalize=True, compressor=compressor, steps=20)
            except AssertionError as failure:
                failures[f"{compressor} run {run}"] = str(failure)[-3000:]
    assert not failures, "\n".join(f"=== {name}\n{report}" for name, report in failures.items())


def test_stress_counts_a_failing_rank_as_abnormal():
    """The counter is not vacuous: a script that fails on every rank is counted, with its output."""
    tally = load_stress_module().stress(["no-such-compressor"], 1, steps=1, progress=False)[
        "no-such-compressor"
    ]
    assert (tally.runs, tally.abnormal, len(tally.failures)) == (1, 1, 2)
    assert all(f["returncode"] == 1 and "no-such-compressor" in f["output_tail"] for f in tally.failures)


# --- no Python on the backend's threads --------------------------------------------------
CONFIGS = {  # name: (compressor, hook options, whether it decodes payloads)
    "sidco-exp": ("sidco-exp", {}, True),  # allgathered payloads
    "fp16": ("fp16", {}, True),  # allreduced values
    "vgc": ("vgc", {}, True),  # VGC's codes
    "topk+dense": ("topk", {"granularity": "layer", "min_numel": 100}, True),  # dense parts beside
    "none": ("none", {}, False),  # stock DDP's in-place allreduce
    "warm-up": ("sidco-exp", {"warmup_steps": 2}, True),  # dense steps, then compressed ones
    "powersgd": ("powersgd", {"start_iter": 2}, False),  # PyTorch's own hooks, dense then compressed
}
STEPS = 4


@contextlib.contextmanager
def recording_then():
    """Record, by name, every Python callback attached with ``Future.then`` to a future that
    is not complete yet (yields the list)."""
    attached_to_pending: list[str] = []
    original_then = torch._C.Future.then

    def recorded_then(future, callback):
        if not future.done():
            attached_to_pending.append(getattr(callback, "__qualname__", repr(callback)))
        return original_then(future, callback)

    torch._C.Future.then = recorded_then
    try:
        yield attached_to_pending
    finally:
        torch._C.Future.then = original_then


def deliberate_callback(future):
    return future.value()


#: How late rank 1 joins the control's allreduce, so that rank 0's is still in flight.
CONTROL_DELAY_S = 1.0


def then_on_purpose(rank: int) -> list[str]:
    """The recorder's positive control: ``then`` attached on purpose to an allreduce in
    flight (rank 1 joins it :data:`CONTROL_DELAY_S` late, so rank 0's cannot be complete),
    and to a future already complete (not recorded)."""
    with recording_then() as attached:
        if rank == 1:
            time.sleep(CONTROL_DELAY_S)
        dist.all_reduce(torch.ones(4), async_op=True).get_future().then(deliberate_callback).wait()
        complete = torch.futures.Future()
        complete.set_result(None)
        complete.then(deliberate_callback).wait()
    return attached


def train_recording_callbacks(rank: int, compressor: str, options: dict) -> dict:
    """Train a few steps; record every Python callback attached to a pending future, and
    the threads that decode."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    state = gradsift.register_comm_hook(model, compressor, **options)
    decode_threads = set()

    def recording(decode):
        def recorded(*args, **kwargs):
            decode_threads.add(threading.get_ident())
            return decode(*args, **kwargs)

        return recorded

    for name in ("decompress", "decompress_into"):  # the hook decodes through either
        setattr(state.compressor, name, recording(getattr(state.compressor, name)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    with recording_then() as attached_to_pending:
        for _ in range(STEPS):
            optimizer.zero_grad()
            model(torch.randn(8, 20, generator=generator)).square().mean().backward()
            optimizer.step()
    return {
        "attached_to_pending": attached_to_pending,
        "decode_threads": "none"
        if not decode_threads
        else ("training" if decode_threads == {threading.get_ident()} else "other"),
        "steps": state.step,
    }


def callbacks_worker(rank: int, world: int) -> dict:
    results = {name: train_recording_callbacks(rank, c, o) for name, (c, o, _) in CONFIGS.items()}
    return {"control": then_on_purpose(rank), **results}


def test_hook_runs_no_python_on_backend_threads():
    """No ``Future.then`` on a collective in flight (its callback would run, and be
    destroyed, on a gloo thread); payloads decode on the thread that runs backward. The
    recorder sees a callback attached on purpose (rank 0's collective is surely in flight;
    rank 1's may have completed)."""
    ranks = run_workers(__file__, "callbacks_worker", 2)
    assert ranks[0].pop("control") == ["deliberate_callback"]
    assert ranks[1].pop("control") in ([], ["deliberate_callback"])
    for by_config in ranks:
        for name, (_, _, decodes) in CONFIGS.items():
            result = by_config[name]
            assert result["attached_to_pending"] == [], name
            assert result["decode_threads"] == ("training" if decodes else "none"), name
            assert result["steps"] == STEPS, name


# --- every collective's Work outlives the script ------------------------------------------
def keeper_worker(rank: int, world: int) -> dict:
    """Train 3 steps recording the Work of every collective started; what the keeper holds."""
    from gradsift.core import collectives

    started_by_step: list[list] = []
    gather = collectives.all_gather_into

    def recording_gather(*args, **kwargs):
        work = gather(*args, **kwargs)
        started_by_step[-1].append(work)
        return work

    collectives.all_gather_into = recording_gather
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    gradsift.register_comm_hook(model, "sidco-exp", exchange="allgather")
    kept_by_step = []
    for _ in range(3):
        started_by_step.append([])
        model(torch.randn(8, 20)).square().mean().backward()
        kept_by_step.append(list(collectives.KEPT_WORKS.works))
    held = collectives.KEPT_WORKS.works
    references = sys.getrefcount(held)
    collectives.KEPT_WORKS.hold_past_exit()  # what atexit runs; this worker exits right after
    return {
        "started": [len(works) for works in started_by_step],
        "kept_is_started": [
            [id(w) for w in kept] == [id(w) for w in started]
            for kept, started in zip(kept_by_step, started_by_step, strict=True)
        ],
        "last_done": all(work.is_completed() for work in kept_by_step[-1]),
        "extra_references": sys.getrefcount(held) - references,
    }


def test_every_collective_of_the_last_step_is_held_past_exit():
    """The keeper holds exactly the works of the step that ran last, released when the next
    step opens, and pins them at exit. One bucket, one fixed-size message: one collective."""
    for result in run_workers(__file__, "keeper_worker", 2):
        assert result["started"] == [1, 1, 1], result
        assert result["kept_is_started"] == [True, True, True], result
        assert result["last_done"] and result["extra_references"] == 1, result
