"""The DDP hook across checkpoints and failures, in real gloo processes.

Checkpoint at step k, resume in fresh processes (state_dict and pickle), compare with
the uninterrupted run; a rank that raises or exits mid-step makes the others fail
within the process group's timeout with PeerFailureError; delegation to PowerSGD.
"""

import pickle
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from distributed_utils import run_workers
from test_ddp import batch, flat_params, hooked, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, CHECKPOINT_AT = 6, 3
RESUME_CASES = {
    "topk-momentum": ("topk", {"ratio": 0.05, "momentum": 0.9}),
    "topk-layer": ("topk", {"ratio": 0.1, "granularity": "layer"}),
}


def run_with_optimizer(model: DDP, rank: int, steps: range, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def uninterrupted_worker(rank: int, world: int, directory: str) -> dict:
    out = {}
    for case, (name, options) in RESUME_CASES.items():
        model, state = hooked(name, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run_with_optimizer(model, rank, range(CHECKPOINT_AT), opt)
        torch.save(
            {
                "model": model.module.state_dict(),
                "opt": opt.state_dict(),
                "hook": state.state_dict(),
                "pickled": pickle.dumps(state),
            },
            f"{directory}/{case}-{rank}.pt",
        )
        run_with_optimizer(model, rank, range(CHECKPOINT_AT, STEPS), opt)
        out[case] = flat_params(model)
    return out


def resumed_worker(rank: int, world: int, directory: str) -> dict:
    out = {}
    for case, (name, options) in RESUME_CASES.items():
        checkpoint = torch.load(f"{directory}/{case}-{rank}.pt", weights_only=False)
        for how in ("state_dict", "pickle"):
            module = make_model()
            module.load_state_dict(checkpoint["model"])
            model = DDP(module)
            if how == "state_dict":
                state = gradsift.register_comm_hook(model, name, **options)
                state.load_state_dict(checkpoint["hook"])
            else:
                restored = pickle.loads(checkpoint["pickled"])
                assert restored.process_group is None  # pickled without its group
                state = gradsift.register_comm_hook(model, restored)
            assert state.step == CHECKPOINT_AT
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.load_state_dict(checkpoint["opt"])
            run_with_optimizer(model, rank, range(CHECKPOINT_AT, STEPS), opt)
            out[f"{case}/{how}"] = flat_params(model)
    return out


def test_checkpoint_resume_in_fresh_processes_matches_uninterrupted_run(tmp_path):
    whole = run_workers(__file__, "uninterrupted_worker", 2, directory=str(tmp_path))
    resumed = run_workers(__file__, "resumed_worker", 2, directory=str(tmp_path))
    for rank in range(2):
        for case in RESUME_CASES:
            for how in ("state_dict", "pickle"):
                assert torch.equal(resumed[rank][f"{case}/{how}"], whole[rank][case]), (case, how, rank)


# --- a rank that fails mid-step -------------------------------------------------------------
def failing_worker(rank: int, world: int, how: str) -> dict:
    model, state = hooked("topk", ratio=0.1)
    train(model, rank, range(2))
    if rank == 1:

        def broken(tensor, **kw):
            if how == "exit":
                import os

                os._exit(3)
            raise RuntimeError("simulated failure inside compress")

        state.compressor.encode = broken  # what the hook calls
        try:
            train(model, rank, range(2, 3))
        except RuntimeError:
            time.sleep(
                12
            )  # stay alive (> the 5 s group timeout) without taking part: the peer must time out, not hang
        return {}
    started = time.monotonic()
    try:
        train(model, rank, range(2, 4))
        return {"error": None}
    except gradsift.errors.PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_surviving_rank_fails_with_clear_error_instead_of_hanging(how):
    timeout = 5.0
    results = run_workers(
        __file__,
        "failing_worker",
        2,
        how=how,
        group_timeout=timeout,
        timeout=120,
        expect_exit={1: 3} if how == "exit" else None,
    )
    survivor = results[0]
    assert survivor["error"] is not None
    assert "failed on rank 0 of 2: a peer process is gone" in survivor["error"]
    assert survivor["seconds"] < 4 * timeout


# --- delegation to a compressor's own DDP hook (PowerSGD) -------------------------------------
def delegation_worker(rank: int, world: int) -> dict:
    model, state = hooked("powersgd", rank=1, start_iter=2)
    train(model, rank, range(4))
    return {"params": flat_params(model), "stats": state.stats()}


def test_powersgd_delegation_is_timed_and_counted():
    runs = run_workers(__file__, "delegation_worker", 2)
    assert torch.equal(runs[0]["params"], runs[1]["params"])
    step = runs[0]["stats"]["step"]
    assert 0 < step["bytes_sent"] < step["dense_bytes"] and step["communicate_ms"] > 0
