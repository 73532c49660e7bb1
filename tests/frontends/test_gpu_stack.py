"""What GPU jobs use, shown where CPU can show it: ``static_graph=True``, compiled autograd's
Python reducer, a ``GradScaler`` with weight decay, clipping and fixed thresholds, a scale
that changes mid-run, and a bf16 model -- each in real gloo processes.

The oracles: stock DDP in the same process (ratio 1 without masking equals stock DDP +
SGD momentum, PyTorch's own arithmetic), and the run without loss scaling (scaling by a
power of two is exact in floating point, so a hook that works on unscaled gradients
gives the unscaled run's numbers whatever the scale does).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
import gradsift.frontends.ddp
from support.distributed import run_workers
from support.models import batch, flat_params, make_model
from support.steps import backward_and_step

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8


def step(model, optimizer, rank: int, i: int, scaler=None) -> None:
    x, y = batch(rank, i)
    optimizer.zero_grad()
    backward_and_step(torch.nn.functional.mse_loss(model(x), y), optimizer, scaler)


# --- static_graph --------------------------------------------------------------------------


def static_worker(rank: int, world: int) -> dict:
    """DDP's first static-graph iteration runs every hook from its own end-of-backward
    callback and then waits for the futures: they must be complete by then."""
    out = {}
    for name, options in (("sidco-exp", {}), ("fp16", {}), ("powersgd", {"start_iter": 2})):
        runs = {}
        for static in (False, True):
            model = DDP(make_model(), static_graph=static)
            gradsift.register_comm_hook(model, name, **options)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(4):
                step(model, optimizer, rank, i)
            runs[static] = flat_params(model)
        out[name] = runs
    return out


def test_static_graph_trains_like_the_dynamic_graph():
    results = run_workers(__file__, "static_worker", 2, timeout=120)
    for name in ("sidco-exp", "fp16", "powersgd"):
        assert torch.equal(results[0][name][True], results[1][name][True]), name  # ranks agree
        torch.testing.assert_close(results[0][name][True], results[0][name][False], rtol=0, atol=0)


# --- compiled autograd's Python reducer -----------------------------------------------------


def python_reducer_worker(rank: int, world: int) -> dict:
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        model = DDP(make_model())
        gradsift.register_comm_hook(model, "sidco-exp")
    except gradsift.core.errors.InvalidOptionError as error:
        return {"error": str(error)}
    finally:
        torch._dynamo.config.optimize_ddp = True
    return {"error": None}


def test_compiled_autograds_python_reducer_is_refused_at_registration():
    (result,) = run_workers(__file__, "python_reducer_worker", 1)
    assert result["error"] is not None and "python_reducer" in result["error"]


def test_a_per_parameter_call_is_refused_by_the_hook_itself():
    """If the reducer is switched after registration, the hook sees (grad, param) tuples."""
    state = gradsift.hook.state.GradsiftHookState.build("topk")
    with pytest.raises(gradsift.core.errors.InvalidOptionError, match="per parameter"):
        gradsift.hook.route.gradsift_hook(state, (torch.zeros(3), torch.nn.Parameter(torch.zeros(3))))


# --- loss scaling ----------------------------------------------------------------------------


def scaled_worker(rank: int, world: int) -> dict:
    """Stock DDP + SGD(momentum, weight decay) + GradScaler against the hook at ratio 1 with the
    optimizer taken over; and each compressor with and without a scaler whose scale moves."""
    out = {}
    stock = DDP(make_model())
    optimizer = torch.optim.SGD(stock.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for i in range(STEPS):
        step(stock, optimizer, rank, i, scaler)
    out["stock"] = flat_params(stock)
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    gradsift.register_comm_hook(
        model, "topk", ratio=1.0, momentum_masking=False, optimizer=optimizer, scaler=scaler
    )
    for i in range(STEPS):
        step(model, optimizer, rank, i, scaler)
    out["topk-ratio-1"] = flat_params(model)
    for name, options in (
        ("topk", {"ratio": 0.2, "clip_norm": 0.05}),  # the clipping triggers at these norms
        ("threshold", {"threshold": 0.02}),
        ("sidco-exp", {"ratio": 0.1}),
    ):
        runs = {}
        for scaled in (False, True):
            model = DDP(make_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
            # growth every 2 steps: the scale doubles during the run (2^12 ... 2^15)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if scaled else None
            state = gradsift.register_comm_hook(model, name, optimizer=optimizer, scaler=scaler, **options)
            scales = []
            for i in range(STEPS):
                step(model, optimizer, rank, i, scaler)
                scales.append(None if scaler is None else scaler.get_scale())
            runs[scaled] = {
                "params": flat_params(model),
                "residuals": {str(k): v for k, v in state.store.table("residual").items()},
                "scales": scales,
            }
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def scaled():
    return run_workers(__file__, "scaled_worker", 2, timeout=180)


def test_ratio_one_under_a_grad_scaler_equals_stock_ddp_with_weight_decay(scaled):
    for result in scaled:
        stock, hooked = result["stock"], result["topk-ratio-1"]
        assert float((hooked - stock).norm() / stock.norm()) <= 1e-4


def test_state_and_results_do_not_depend_on_the_loss_scale(scaled):
    """Weight decay, clipping and fixed thresholds act on unscaled gradients, residuals are
    stored unscaled: the run whose scale doubles three times equals the unscaled run."""
    for result in scaled:
        for name in ("topk", "threshold", "sidco-exp"):
            plain, scaled_run = result[name][False], result[name][True]
            assert scaled_run["scales"][-1] > scaled_run["scales"][0]  # the scale did change
            torch.testing.assert_close(scaled_run["params"], plain["params"], rtol=1e-6, atol=1e-7)
            assert scaled_run["residuals"].keys() == plain["residuals"].keys()
            for key, residual in plain["residuals"].items():
                torch.testing.assert_close(scaled_run["residuals"][key], residual, rtol=1e-5, atol=1e-7)
    assert torch.equal(scaled[0]["topk"][True]["params"], scaled[1]["topk"][True]["params"])


# --- a bf16 model ----------------------------------------------------------------------------


def bf16_worker(rank: int, world: int) -> dict:
    model = DDP(make_model().to(torch.bfloat16))
    state = gradsift.register_comm_hook(model, "topk", ratio=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(12):
        x, y = batch(rank, i % 2)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return {
        "params": flat_params(model),
        "losses": losses,
        "residual_dtypes": {str(v.dtype) for v in state.store.table("residual").values()},
        "grad_dtype": str(next(model.parameters()).grad.dtype),
    }


def test_a_bf16_model_keeps_float32_residuals_and_trains():
    results = run_workers(__file__, "bf16_worker", 2, timeout=120)
    assert torch.equal(results[0]["params"], results[1]["params"])
    for result in results:
        assert result["residual_dtypes"] == {"torch.float32"} and result["grad_dtype"] == "torch.bfloat16"
        assert result["losses"][-1] < result["losses"][0]
