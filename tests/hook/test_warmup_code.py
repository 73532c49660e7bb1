"""``warmup_compressor=``: a frozen-variance Adam method's warm-up in a quantizer's codes
(gradsift.hook.warmup_code) instead of stock DDP's fp32 allreduce.

The oracle is the method written out here from its definition, for two workers simulated in
one process (no hook, no DDP):

* steps ``< T``: each worker ``k`` codes ``c_k = g_k + r_k`` per layer in 4-bit block codes
  (blocks of 64, absmax scale ``s``, ``q = round(7 c / s)``, decoded ``q s / 7``), keeps
  ``r_k <- c_k - Q(c_k)``, and AdamW steps on the workers' mean of ``Q(c_k)`` after
  ``clip_grad_norm_``;
* from ``T``: the frozen-variance method (tests/hook/test_adam.py's oracle) with every
  coordinate sent (top-k at ratio 1, no masking), where the first compressed step also sends
  the residuals the warm-up left: ``m = (1 - beta1)(mean_k u_k + mean_k r_k)``.
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

STEPS, WARMUP, LR, WD, BETAS, WORLD = 9, 4, 0.01, 0.1, (0.9, 0.99), 2
EXACT = {"ratio": 1.0, "momentum_masking": False, "granularity": "layer"}


def reference_run() -> torch.Tensor:
    """The method by hand (module docstring), both workers in this process."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    params = list(model.parameters())
    residual = [[torch.zeros(p.numel()) for p in params] for _ in range(WORLD)]
    velocity, preconditioner = {}, {}
    for step in range(STEPS):
        per_worker = [flat_gradients(model, k, step) for k in range(WORLD)]
        with torch.no_grad():
            if step < WARMUP:
                for i, p in enumerate(params):
                    g = [per_worker[k][i] for k in range(WORLD)]
                    p.grad = error_feedback_mean(g, [r[i] for r in residual], four_bit_blocks).reshape(
                        p.shape
                    )
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                continue
            left = [torch.zeros(p.numel()) for p in params]
            if not velocity:  # the first compressed step also sends what the warm-up left
                velocity, preconditioner = frozen_variance_start(optimizer, params, BETAS)
                left = [sum(r[i] for r in residual) / WORLD for i in range(len(params))]
            means = [sum(per_worker[k][i] for k in range(WORLD)) / WORLD for i in range(len(params))]
            frozen_variance_step(params, means, velocity, preconditioner, left, BETAS[0], LR, WD)
    return flat_params(model)


def hooked_run(
    rank: int, name: str, options: dict, resume_at: int | None = None
) -> tuple[torch.Tensor, dict]:
    """The user's loop with the one line (and a checkpoint and a restart into fresh objects
    at ``resume_at``); the hook's stats after the first step and at the end."""

    def fresh():
        model = DDP(make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        state = gradsift.register_comm_hook(
            model, name, optimizer=optimizer, warmup_steps=WARMUP, warmup_compressor="blockquant", **options
        )
        return model, optimizer, state

    seen = {}

    def after_step(step: int, state) -> None:
        if step == 0:
            seen["first"] = state.stats()["step"]
        seen["last"] = state.stats()["step"]

    model = train_with_restart(fresh, STEPS, lambda m, step: loss_of(m, rank, step), resume_at, after_step)
    return flat_params(model), seen


def worker(rank: int, world: int) -> dict:
    exact, stats = hooked_run(rank, "topk", EXACT)
    whole, _ = hooked_run(rank, "efsignsgd", {})
    resumed = {at: hooked_run(rank, "efsignsgd", {}, resume_at=at)[0] for at in (1, WARMUP - 1, WARMUP)}
    return {"exact": exact, "stats": stats, "whole": whole, "resumed": resumed}


@pytest.fixture(scope="module")
def runs():
    return run_workers(__file__, "worker", WORLD, timeout=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_coded_warm_up_equals_the_method_written_out(runs):
    reference = reference_run()
    for result in runs:
        torch.testing.assert_close(result["exact"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_warm_up_step_sends_the_codes_bytes(runs):
    """Per layer (granularity='layer'): 4-bit codes, one fp32 scale per 64 elements and the
    one-byte non-finite flag every payload carries."""
    numels = [p.numel() for p in make_model().parameters()]
    codes = sum(math.ceil(n * 4 / 8) + 4 * math.ceil(n / 64) + 1 for n in numels)
    for result in runs:
        first = result["stats"]["first"]
        assert first["bytes_sent"] == codes
        assert first["dense_bytes"] == 4 * sum(numels)


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_is_bit_for_bit_in_the_warm_up_and_at_the_switch(runs):
    """Restarts into a fresh DDP model, whose first step has DDP's initial bucket layout: after
    the first step, in the warm-up's last step, at the first compressed step."""
    assert_every_resume_is_the_whole_run(runs)
    assert torch.equal(runs[0]["whole"], runs[1]["whole"])  # the replicas agree


def two_stage_worker(rank: int, world: int) -> dict:
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    state = gradsift.register_comm_hook(
        model,
        "efsignsgd",
        optimizer=optimizer,
        warmup_steps=WARMUP,
        warmup_compressor="blockquant",
        exchange="two-stage",
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
    return {
        "params": flat_params(model),
        "exchanges": (state.exchange.name, state.coded_warmup.exchange.name),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_with_the_two_stage_exchange_the_warm_up_code_takes_it_too_and_the_replicas_agree():
    results = run_workers(__file__, "two_stage_worker", 4, timeout=120)
    assert all(r["exchanges"] == ("two-stage", "two-stage") for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    assert torch.isfinite(results[0]["params"]).all()


def refusal(optimizer_of, compressor: str = "efsignsgd", **options) -> str:
    """The error the one line, or its first step, raises (a 1-rank gloo group in this process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29641", rank=0, world_size=1)
    model = DDP(make_model())
    optimizer = optimizer_of(model)
    with pytest.raises(InvalidOptionError) as raised:
        gradsift.register_comm_hook(model, compressor, optimizer=optimizer, **options)
        loss_of(model, 0, 0).backward()
    return str(raised.value)


def refusals_worker(rank: int, world: int) -> dict:
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=LR)  # noqa: E731
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)  # noqa: E731
    return {
        "sparsifier": refusal(adamw, warmup_compressor="topk"),
        "stochastic": refusal(adamw, warmup_compressor="qsgd"),
        "sgd": refusal(sgd, warmup_compressor="blockquant"),
        "update": refusal(adamw, warmup_compressor="blockquant", adam="update"),
        "type": refusal(adamw, warmup_compressor=4),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_what_cannot_code_a_warm_up_is_refused_by_name():
    (result,) = run_workers(__file__, "refusals_worker", 1)
    for kind in ("sparsifier", "stochastic"):
        assert "deterministic quantizer" in result[kind] and "blockquant" in result[kind]
    assert "'topk'" in result["sparsifier"] and "'qsgd'" in result["stochastic"]
    for kind in ("sgd", "update"):
        assert "frozen-variance Adam method" in result[kind] and "drop warmup_compressor=" in result[kind]
    assert "'efsignsgd' without an Adam optimizer" in result["sgd"] and "adam='update'" in result["update"]
    assert "registry name or a Compressor" in result["type"]
