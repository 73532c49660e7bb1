"""``variance_refresh=``: a frozen-variance Adam method's second moment estimated again over a
window of later steps (gradsift.hook.variance_refresh).

The oracle is the method written out from its definition, two workers simulated in one
process (no hook, no DDP): AdamW dense for ``WARMUP`` steps, then the frozen-variance method
(tests/hook/test_adam.py's oracle, every coordinate sent: top-k at ratio 1, no masking);
over the window's steps the workers' gradients also travel -- exactly (fp32) or each in
4-bit block codes without error feedback (blocks of 64 per layer, absmax scale ``s``,
``q = round(7 g / s)``, decoded ``q s / 7``) -- and the squares of their means are summed;
at the window's last step, before its update, the bias-corrected second moment becomes
``beta2^e v + (1 - beta2^e) sum / L`` (``e``: the steps from the freeze to the window's end)
where the sum is positive and stays where it is zero.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers
from support.models import flat_gradients, flat_params, loss_of, make_model
from support.oracles import error_feedback_mean, four_bit_blocks, frozen_variance_start, frozen_variance_step
from support.steps import assert_every_resume_is_the_whole_run, train_with_restart

STEPS, WARMUP, LR, WD, BETAS, WORLD, EPS = 10, 3, 0.01, 0.1, (0.9, 0.99), 2, 1e-8
WINDOW = (5, 3)  # hook steps 5, 6, 7; the new second moment from step 7 on
EXACT = {"ratio": 1.0, "momentum_masking": False, "granularity": "layer"}


def reference_run(coded: bool) -> torch.Tensor:
    """The method by hand (module docstring), both workers in this process; ``coded``: the
    warm-up and the window in the 4-bit codes (``warmup_compressor="blockquant"``)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    params = list(model.parameters())
    code = four_bit_blocks if coded else torch.clone
    start, length = WINDOW
    velocity, preconditioner, squares = {}, {}, {}
    residual = [[torch.zeros(p.numel()) for p in params] for _ in range(WORLD)]
    for step in range(STEPS):
        per_worker = [flat_gradients(model, k, step) for k in range(WORLD)]
        with torch.no_grad():
            if step < WARMUP:  # tests/hook/test_warmup_code.py's warm-up, with error feedback
                for i, p in enumerate(params):
                    g = [per_worker[k][i] for k in range(WORLD)]
                    p.grad = error_feedback_mean(g, [r[i] for r in residual], code).reshape(p.shape)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                continue
            left = [torch.zeros(p.numel()) for p in params]
            if not velocity:  # the first compressed step also sends what the warm-up left
                velocity, preconditioner = frozen_variance_start(optimizer, params, BETAS)
                left = [sum(r[i] for r in residual) / WORLD for i in range(len(params))]
            if start <= step < start + length:  # the window: each worker's code, no error feedback
                for i, p in enumerate(params):
                    mean = (sum(code(per_worker[k][i]) for k in range(WORLD)) / WORLD).reshape(p.shape)
                    squares[p] = squares.get(p, torch.zeros_like(p)) + mean * mean
            if step == start + length - 1:
                for p in params:
                    state = optimizer.state[p]
                    old = state["exp_avg_sq"] / (1 - BETAS[1] ** float(state["step"]))
                    estimate, keep = squares[p] / length, BETAS[1] ** (start + length - WARMUP)
                    moved = keep * old + (1 - keep) * estimate
                    preconditioner[p] = torch.where(estimate > 0, moved, old).sqrt() + EPS
            means = [sum(per_worker[k][i] for k in range(WORLD)) / WORLD for i in range(len(params))]
            frozen_variance_step(params, means, velocity, preconditioner, left, BETAS[0], LR, WD)
    return flat_params(model)


def hooked_run(
    rank: int, name: str, options: dict, resume_at: int | None = None
) -> tuple[torch.Tensor, list[dict]]:
    """The user's loop with the one line (a checkpoint and a restart into fresh objects at
    ``resume_at``); the hook's step stats after every step."""

    def fresh():
        model = DDP(make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        state = gradsift.register_comm_hook(
            model, name, optimizer=optimizer, warmup_steps=WARMUP, variance_refresh=(WINDOW,), **options
        )
        return model, optimizer, state

    seen: list[dict] = []
    model = train_with_restart(
        fresh,
        STEPS,
        lambda m, step: loss_of(m, rank, step),
        resume_at,
        lambda _, s: seen.append(s.stats()["step"]),
    )
    return flat_params(model), seen


def worker(rank: int, world: int) -> dict:
    exact, _ = hooked_run(rank, "topk", EXACT)
    coded, _ = hooked_run(rank, "topk", {**EXACT, "warmup_compressor": "blockquant"})
    whole, steps = hooked_run(rank, "efsignsgd", {"warmup_compressor": "blockquant", "granularity": "layer"})
    resumed = {
        at: hooked_run(rank, "efsignsgd", {"warmup_compressor": "blockquant", "granularity": "layer"}, at)[0]
        for at in (WINDOW[0] + 1, sum(WINDOW) - 1, sum(WINDOW))
    }
    return {"exact": exact, "coded": coded, "whole": whole, "steps": steps, "resumed": resumed}


@pytest.fixture(scope="module")
def runs():
    return run_workers(__file__, "worker", WORLD, timeout=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_refresh_equals_the_method_written_out(runs):
    exact, coded = reference_run(coded=False), reference_run(coded=True)
    assert not torch.allclose(exact, coded, rtol=1e-5, atol=1e-6)  # the code's rounding shows
    for result in runs:
        torch.testing.assert_close(result["exact"], exact, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["coded"], coded, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_window_step_sends_the_code_beside_the_method(runs):
    """Per layer: a 1-bit step is the signs and one fp32 scale per layer; a window step adds
    the 4-bit codes, an fp32 scale per 64 elements and the one-byte flag per payload."""
    numels = [p.numel() for p in make_model().parameters()]
    code = sum(math.ceil(n * 4 / 8) + 4 * math.ceil(n / 64) + 1 for n in numels)
    for result in runs:
        steps = [s["bytes_sent"] for s in result["steps"]]
        plain = steps[WINDOW[0] - 1]
        assert steps[WINDOW[0] : sum(WINDOW)] == [plain + code] * WINDOW[1]
        assert steps[sum(WINDOW)] == plain


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_is_bit_for_bit_inside_the_window_at_its_end_and_after(runs):
    assert_every_resume_is_the_whole_run(runs)
    assert torch.equal(runs[0]["whole"], runs[1]["whole"])  # the replicas agree


def refusal(optimizer_of=torch.optim.AdamW, **options) -> str:
    """The error the one line, or its first step, raises (a 1-rank gloo group in this process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29643", rank=0, world_size=1)
    model = DDP(make_model())
    optimizer = optimizer_of(model.parameters(), lr=LR)
    with pytest.raises(InvalidOptionError) as raised:
        gradsift.register_comm_hook(model, "efsignsgd", optimizer=optimizer, **options)
        loss_of(model, 0, 0).backward()
    return str(raised.value)


def refusals_worker(rank: int, world: int) -> dict:
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    return {
        "measured": refusal(variance_refresh=((10, 2),)),
        "inside": refusal(warmup_steps=5, variance_refresh=((3, 2),)),
        "overlap": refusal(warmup_steps=1, variance_refresh=((3, 2), (4, 2))),
        "shape": refusal(warmup_steps=1, variance_refresh=(3, 2)),
        "empty": refusal(warmup_steps=1, variance_refresh=((3, 0),)),
        "update": refusal(warmup_steps=1, adam="update", variance_refresh=((3, 2),)),
        "sgd": refusal(sgd, variance_refresh=((3, 2),)),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_a_refresh_the_hook_cannot_run_is_refused_by_name():
    (result,) = run_workers(__file__, "refusals_worker", 1)
    assert "pass warmup_steps=" in result["measured"]
    assert "starts inside the warm-up of 5 steps" in result["inside"]
    assert "overlap" in result["overlap"]
    for kind in ("shape", "empty"):
        assert "(start, steps) pairs" in result[kind]
    for kind in ("update", "sgd"):
        assert "frozen-variance Adam method" in result[kind]


def two_stage_worker(rank: int, world: int) -> dict:
    params, _ = hooked_run(rank, "efsignsgd", {"warmup_compressor": "blockquant", "exchange": "two-stage"})
    return {"params": params}


@pytest.mark.slow
@pytest.mark.distributed
def test_through_the_two_stage_exchange_every_rank_estimates_the_same_variance():
    """The window's code travels by the warm-up's exchange, here 1-bit Adam's two-stage one,
    whose mean every rank holds the same: the replicas agree on 4 ranks."""
    results = run_workers(__file__, "two_stage_worker", 4, timeout=120)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    assert torch.isfinite(results[0]["params"]).all()
