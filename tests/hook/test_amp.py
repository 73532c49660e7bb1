"""Mixed precision as most GPU users run it: autocast(fp16) + GradScaler, with the one line
(``scaler=`` passed; without it the first optimizer step refuses: tests/hook/test_first_step.py).

``GradScaler(init_scale=2**60)`` makes the first ~40 steps overflow in fp16. Stock DDP
hands the overflow to the scaler, which skips those steps and halves its scale each
time. With the hook (default options, every registry compressor) on 2 gloo ranks:

* the scale trajectory equals stock DDP's, step for step;
* the overflowing steps leave no trace: the hook's state after them equals its fresh
  state, and the run ends bit-identical to a run that started at the backed-off scale
  and never overflowed (so no residual, velocity, accumulator, adaptation, generator or
  step counter absorbed them);
* ranks end bit-identical and the loss goes down.
bf16 autocast needs no scaler: it trains and ranks agree.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.models import IN, OUT, batch, flat_params, hook_state, make_model, same

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

APPLIED = 6  # optimizer steps applied after the scaler stopped overflowing
OPTIONS = {"powersgd": {"start_iter": 2}, "threshold": {"threshold": 1e-3}}  # no default threshold


#: One parameter (``make_model(WIDTHS, bias=False)``: one Linear), so DDP's bucket layout
#: never changes (DDP rebuilds its buckets after the first backward; with several parameters
#: the overflowing run's first applied step would see another flat order than the clean
#: run's, and random or tie-breaking selections would differ for that reason alone).
WIDTHS = (IN, OUT)


def trace(state) -> dict:
    """What a dropped step could leave behind: stored tensors, compressor state, the step."""
    saved = hook_state(state)
    saved["store"] = saved["store"]["tables"]
    return saved


def amp_run(name: str | None, rank: int, init_scale: float) -> dict:
    """Train until APPLIED steps were applied; batch i feeds the i-th applied step."""
    model = DDP(make_model(WIDTHS, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = None
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    if name is not None:
        state = gradsift.register_comm_hook(
            model, name, optimizer=optimizer, scaler=scaler, **OPTIONS.get(name, {})
        )
        fresh = trace(state)
    scales, losses, applied, overflowed = [], [], 0, 0
    while applied < APPLIED:
        x, y = batch(rank, applied)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < scale:
            overflowed += 1
            if state is not None and applied == 0 and overflowed == 1:
                first_overflow = trace(state)
        else:
            applied += 1
            losses.append(float(loss.detach()))
        scales.append(scale)
    x, y = batch(rank, 0)
    with torch.no_grad():
        losses.append(float(torch.nn.functional.mse_loss(model(x), y)))  # the first batch again, trained
    out = {"scales": scales, "losses": losses, "params": flat_params(model), "overflowed": overflowed}
    if state is not None:
        out["state"] = hook_state(state)
        out["fresh"] = fresh
        out["after_first_overflow"] = first_overflow if overflowed else fresh
    return out


def amp_worker(rank: int, world: int, names: list[str]) -> dict:
    stock = amp_run(None, rank, 2.0**60)
    backed_off = stock["scales"][-1]
    results = {"stock": stock}
    for name in names:
        results[name] = {
            "overflowing": amp_run(name, rank, 2.0**60),
            "clean": amp_run(name, rank, backed_off),
        }
    return results


def bf16_worker(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        model = DDP(make_model(WIDTHS, bias=False))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = gradsift.register_comm_hook(model, name, optimizer=optimizer, **OPTIONS.get(name, {}))
        losses = []
        for step in range(8):
            x, y = batch(rank, step % 2)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        results[name] = {
            "losses": losses,
            "params": flat_params(model),
            "skipped": state.stats()["total"]["skipped_steps"],
        }
    return results


NAMES = gradsift.available_compressors()


@pytest.fixture(scope="module")
def amp_runs():
    return run_workers(__file__, "amp_worker", 2, timeout=400, names=NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_gradscaler_backs_off_as_with_stock_ddp_and_overflows_leave_no_trace(name, amp_runs):
    for rank, runs in enumerate(amp_runs):
        stock, got, clean = runs["stock"], runs[name]["overflowing"], runs[name]["clean"]
        where = f"{name}/rank {rank}"
        assert stock["overflowed"] >= 30, "the setup must overflow for many steps"
        assert got["scales"] == stock["scales"], f"{where}: scale trajectory differs from stock DDP"
        assert clean["overflowed"] == 0, where
        assert torch.equal(got["params"], clean["params"]), f"{where}: the overflows changed the training"
        if name == "none":  # stock DDP: no state, and no flag read, so the step counter counts them
            assert got["state"]["step"] == clean["state"]["step"] + got["overflowed"], where
            continue
        assert same(got["after_first_overflow"], got["fresh"]), f"{where}: an overflowing step left state"
        assert same(got["state"], clean["state"]), f"{where}: the overflows changed the hook state"
        assert got["losses"][-1] < got["losses"][0], where  # the first batch's loss went down
    assert torch.equal(amp_runs[0][name]["overflowing"]["params"], amp_runs[1][name]["overflowing"]["params"])


def test_bf16_autocast_trains_through_the_hook():
    names = ["sidco-exp", "topk", "vgc", "powersgd", "qsgd"]
    runs = run_workers(__file__, "bf16_worker", 2, timeout=200, names=names)
    for name in names:
        for result in runs:
            assert result[name]["skipped"] == 0
            assert result[name]["losses"][-2] < result[name]["losses"][0], name  # batch 0, 6 steps later
        assert torch.equal(runs[0][name]["params"], runs[1][name]["params"]), name
