"""Every compressor trains with its one line (issue 42, item 4).

``gradsift.register_comm_hook(ddp, name)`` and nothing else -- no ``optimizer=``: the hook
adopts the optimizer it finds (gradsift.hook.discovery) -- for every registry name, under
SGD with momentum 0.9 and under AdamW, on 2 real gloo ranks. The oracle is stock DDP
trained in the same worker on the same data stream: each run's held-out loss must fall
to under :data:`FALLS` of where it started and end within the stated factor of stock
DDP's final loss (:data:`FACTOR`). The task: a 32-64-8 tanh MLP regressing a fixed linear
teacher, whose stock loss falls about 80x in :data:`STEPS` steps.

The factors say what the one line costs at equal steps, not a speed target: sparsifiers
at their default 1 % density send each position about once in 100 steps, so they trail
stock DDP on a run this short (random-k and CocktailSGD's rolling subset most). Under
AdamW the first 64 steps are the one line's dense warm-up (gradsift.hook.adam); the
compressed steps after it must keep the loss where stock DDP's goes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

IN, HIDDEN, OUT, BATCH = 32, 64, 8, 16
#: Steps per run: under AdamW, 64 dense then 56 compressed.
STEPS = {"sgd": 120, "adamw": 120}
#: A run's final held-out loss must be under this share of its first.
FALLS = 0.3
#: ... and within this factor of stock DDP's final loss in the same worker.
FACTOR = {"sgd": 12.0, "adamw": 2.0}
#: The one option a compressor cannot train without (it has no default).
REQUIRED = {"threshold": {"threshold": 0.01}}


def optimizer_for(family: str, params) -> torch.optim.Optimizer:
    if family == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3)


def train(rank: int, family: str, compressor: str | None, options: dict) -> list[float]:
    """Held-out loss after each step; ``compressor`` None is stock DDP."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    ddp = DDP(module)
    if compressor is not None:
        gradsift.register_comm_hook(ddp, compressor, **options)
    optimizer = optimizer_for(family, ddp.parameters())
    teacher = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(7)) / IN**0.5
    held_out = torch.randn(256, IN, generator=torch.Generator().manual_seed(99))
    losses = []
    for step in range(STEPS[family]):
        x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(10_000 * rank + step))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x @ teacher.T).backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(module(held_out), held_out @ teacher.T).item())
    return losses


def worker(rank: int, world: int) -> dict:
    del world
    results: dict = {}
    for family in STEPS:
        results[(family, None)] = train(rank, family, None, {})
        for name in gradsift.available_compressors():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a run's warnings are not what this test judges
                results[(family, name)] = train(rank, family, name, REQUIRED.get(name, {}))
    return results


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_workers(__file__, "worker", 2, timeout=300)[0]


@pytest.mark.parametrize("family", list(STEPS))
@pytest.mark.parametrize("name", gradsift.available_compressors())
def test_the_one_line_trains(runs, family, name):
    stock, losses = runs[(family, None)], runs[(family, name)]
    assert stock[-1] < 0.05 * stock[0]  # the task: stock DDP learns it
    assert losses[-1] < FALLS * losses[0], f"{name}/{family}: {losses[0]:.3f} -> {losses[-1]:.3f}"
    ratio = losses[-1] / stock[-1]
    assert ratio < FACTOR[family], (
        f"{name}/{family}: final {losses[-1]:.4f} = {ratio:.1f}x stock's {stock[-1]:.4f}"
    )


def test_a_compressor_with_a_required_option_names_it(one_process_group):
    """``threshold`` has no default threshold (it is in the gradients' units): the one line
    without it is refused naming the option, not a TypeError from the constructor."""
    ddp = DDP(torch.nn.Linear(4, 4))
    with pytest.raises(InvalidOptionError, match=r"'threshold' needs threshold="):
        gradsift.register_comm_hook(ddp, "threshold")


def test_powersgd_leaves_sgd_momentum_to_the_optimizer(one_process_group):
    """PowerSGD is not momentum-corrected (its paper applies momentum to the exchanged mean):
    an adopted SGD keeps its momentum and the hook's error feedback runs without one;
    top-k's takes it over (DGC's momentum correction)."""
    for name, hook_momentum, kept in (("powersgd", 0.0, 0.9), ("topk", 0.9, 0.0)):
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        state = gradsift.register_comm_hook(ddp, name, optimizer=optimizer)
        assert state.feedback.momentum == hook_momentum
        assert optimizer.param_groups[0]["momentum"] == kept


def _adamw_run(one_line: dict, steps: int = 8) -> list[torch.Tensor]:
    """AdamW on a DDP model hooked with ``powersgd`` and ``one_line``; the parameters after ``steps``."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4)))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = gradsift.register_comm_hook(ddp, "powersgd", start_iter=2, **one_line)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
    assert state.adam is None and state.feedback.momentum == 0.0  # AdamW kept its moments
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999) and optimizer.state
    return [p.detach().clone() for p in ddp.parameters()]


def test_powersgd_leaves_adam_to_the_optimizer(one_process_group):
    """Under AdamW, PowerSGD's one line runs no Adam method in the hook: the discovered AdamW
    steps on the exchanged mean as it would with ``optimizer=False`` (no adoption), bit for bit,
    past ``start_iter`` -- and an ``adam=`` method it cannot run is refused, naming it."""
    found, by_hand = _adamw_run({}), _adamw_run({"optimizer": False})
    assert all(torch.equal(a, b) for a, b in zip(found, by_hand, strict=True))
    ddp = DDP(torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(ddp.parameters())
    with pytest.raises(InvalidOptionError, match=r"adam='onebit'.*'powersgd' leaves AdamW its moments"):
        gradsift.register_comm_hook(ddp, "powersgd", optimizer=optimizer, adam="onebit")
    # no second moment to freeze, so no dense warm-up to require: warmup_steps=0 is PowerSGD's own, not refused
    sparse = DDP(torch.nn.Linear(4, 4))
    with pytest.raises(InvalidOptionError, match=r"warmup_steps=0 with adam='frozen-variance'"):
        gradsift.register_comm_hook(
            sparse, "topk", optimizer=torch.optim.AdamW(sparse.parameters()), warmup_steps=0
        )
    state = gradsift.register_comm_hook(ddp, "powersgd", optimizer=optimizer, warmup_steps=0, start_iter=2)
    assert state.adam is None and state.options.warmup_steps == 0
