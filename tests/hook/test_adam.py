"""``optimizer=`` with Adam and AdamW (gradsift.hook.adam): error feedback on the first moment, the
second frozen after a dense warm-up.

The oracle is the method written out in this file from its definition (1-bit Adam's frozen
variance with DGC's momentum correction; docs/choosing.md): stock DDP averages the
gradients, and the update is computed by hand --

* steps ``< T``: the optimizer as built (stock DDP + Adam/AdamW);
* at ``T``: ``D = sqrt(v / (1 - beta2^t)) + eps`` and ``u = m / ((1 - beta1)(1 - beta1^t))``
  from the optimizer's state;
* then ``u <- beta1 u + g`` (Adam's L2 decay: ``g + wd theta``), ``m = (1 - beta1) u`` is
  what ``.grad`` holds (the user's clipping applies to it), and
  ``theta <- theta (1 - lr wd) - lr m / D`` (AdamW) / ``theta - lr m / D`` (Adam).

At ratio 1 without momentum masking the hook sends everything, so it must equal that
oracle; with a sparsifier it must resume bit for bit and not care about the loss scale.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.adam import FrozenVarianceStep
from support.distributed import run_workers
from support.models import IN, batch, flat_params, make_model
from support.oracles import frozen_variance_start

STEPS, WARMUP, LR, WD, BETAS = 12, 4, 0.01, 0.1, (0.9, 0.99)


def schedule(step: int) -> float:
    return 1.0 / (1 + 0.1 * step)  # the scheduler changes lr every step


def build(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer_class = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return optimizer_class(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def reference_run(rank: int, kind: str) -> torch.Tensor:
    """The method by hand on stock DDP (module docstring)."""
    model = DDP(make_model())
    optimizer = build(kind, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    params = list(model.parameters())
    beta1 = BETAS[0]
    velocity, preconditioner = {}, {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        if step < WARMUP:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        else:
            with torch.no_grad():
                if not velocity:
                    velocity, preconditioner = frozen_variance_start(optimizer, params, BETAS)
                for p in params:
                    g = p.grad + (WD * p if kind == "adam" else 0)
                    velocity[p] = beta1 * velocity[p] + g
                    p.grad = (1 - beta1) * velocity[p]
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                lr = optimizer.param_groups[0]["lr"]
                for p in params:
                    if kind == "adamw":
                        p.mul_(1 - lr * WD)
                    p.sub_(lr * p.grad / preconditioner[p])
        scheduler.step()
    return flat_params(model)


def hooked_run(rank: int, kind: str, name: str, options: dict, scaler_scale: float | None = None,
               resume_at: int | None = None) -> tuple[torch.Tensor, list[float]]:  # fmt: skip
    """The user's loop with the one line (and optionally a GradScaler, or a checkpoint and a
    restart into fresh objects at ``resume_at``)."""

    def fresh():
        model = DDP(make_model())
        optimizer = build(kind, model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        scaler = (
            None
            if scaler_scale is None
            else torch.amp.GradScaler("cpu", init_scale=scaler_scale, growth_interval=2)
        )
        state = gradsift.register_comm_hook(
            model, name, optimizer=optimizer, warmup_steps=WARMUP, scaler=scaler, **options
        )
        return model, optimizer, scheduler, scaler, state

    model, optimizer, scheduler, scaler, state = fresh()
    scales = []
    for step in range(STEPS):
        if step == resume_at:
            saved = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "hook": state.state_dict(),
                "scaler": None if scaler is None else scaler.state_dict(),
            }
            model, optimizer, scheduler, scaler, state = fresh()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            state.load_state_dict(saved["hook"])
            if scaler is not None:
                scaler.load_state_dict(saved["scaler"])
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        scheduler.step()
    return flat_params(model), scales


def equivalence_worker(rank: int, world: int) -> dict:
    exact = {"ratio": 1.0, "momentum_masking": False}
    return {
        kind: {"reference": reference_run(rank, kind), "hook": hooked_run(rank, kind, "topk", exact)[0]}
        for kind in ("adamw", "adam")
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_ratio_one_equals_the_frozen_variance_method_written_out():
    for result in run_workers(__file__, "equivalence_worker", 2, timeout=120):
        for kind in ("adamw", "adam"):
            torch.testing.assert_close(result[kind]["hook"], result[kind]["reference"], rtol=1e-5, atol=1e-6)


def sparse_worker(rank: int, world: int) -> dict:
    options = {"ratio": 0.05}
    whole, _ = hooked_run(rank, "adamw", "sidco-exp", options)
    resumed, _ = hooked_run(rank, "adamw", "sidco-exp", options, resume_at=WARMUP + 3)
    across_warmup, _ = hooked_run(rank, "adamw", "sidco-exp", options, resume_at=WARMUP - 1)
    plain, _ = hooked_run(rank, "adamw", "topk", {"ratio": 0.05})
    scaled, scales = hooked_run(rank, "adamw", "topk", {"ratio": 0.05}, scaler_scale=2.0**12)
    return {
        "whole": whole, "resumed": resumed, "across_warmup": across_warmup,
        "plain": plain, "scaled": scaled, "scales": scales,
    }  # fmt: skip


@pytest.fixture(scope="module")
def sparse():
    return run_workers(__file__, "sparse_worker", 2, timeout=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_is_bit_for_bit_in_the_compressed_phase_and_across_the_freeze(sparse):
    for result in sparse:
        assert torch.equal(result["resumed"], result["whole"])
        assert torch.equal(result["across_warmup"], result["whole"])
    assert torch.equal(sparse[0]["whole"], sparse[1]["whole"])  # ranks agree


@pytest.mark.slow
@pytest.mark.distributed
def test_a_grad_scaler_changes_nothing(sparse):
    """A scale that doubles during the run: the state is unscaled, so the run equals the
    unscaled one (scaling by powers of two is exact)."""
    for result in sparse:
        assert result["scales"][-1] > result["scales"][0]
        torch.testing.assert_close(result["scaled"], result["plain"], rtol=1e-6, atol=1e-7)


# --- what is refused, and how ----------------------------------------------------------------


def refusal(optimizer_of, **options) -> str:
    """The error register_comm_hook raises (a 1-rank gloo group in this process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29633", rank=0, world_size=1)
    model = DDP(make_model())
    with pytest.raises(InvalidOptionError) as raised:
        gradsift.register_comm_hook(model, "topk", optimizer=optimizer_of(model), **options)
    return str(raised.value)


def refusals_worker(rank: int, world: int) -> dict:
    params = lambda model: model.parameters()  # noqa: E731
    return {
        "rmsprop": refusal(lambda m: torch.optim.RMSprop(params(m), momentum=0.9), warmup_steps=3),
        "adagrad": refusal(lambda m: torch.optim.Adagrad(params(m)), warmup_steps=3),
        "amsgrad": refusal(lambda m: torch.optim.AdamW(params(m), amsgrad=True), warmup_steps=3),
        "maximize": refusal(lambda m: torch.optim.Adam(params(m), maximize=True), warmup_steps=3),
        "two_betas": refusal(
            lambda m: torch.optim.AdamW(
                [
                    {"params": list(m.parameters())[:2], "betas": (0.9, 0.99)},
                    {"params": list(m.parameters())[2:], "betas": (0.8, 0.99)},
                ]
            ),
            warmup_steps=3,
        ),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_unsupported_optimizers_and_settings_are_refused_by_name():
    (result,) = run_workers(__file__, "refusals_worker", 1)
    assert "supports torch.optim.SGD" in result["rmsprop"] and "RMSprop" in result["rmsprop"]
    assert "Adagrad" in result["adagrad"] and "Lion" in result["adagrad"]
    assert "amsgrad=True" in result["amsgrad"]
    assert "maximize=True" in result["maximize"]
    assert "different beta1" in result["two_betas"]


def test_frozen_variance_step_leaves_a_non_compressed_step_to_the_optimizer():
    """Before the hook hands it a compressed step, the pre-hook does nothing: the optimizer
    steps as built (here on a plain model, no process group)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    numbers = {id(p): i for i, p in enumerate(model.parameters())}
    step = FrozenVarianceStep(optimizer, numbers, warmup_steps=2)
    twin = make_model()
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=LR)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        loss_of(m, 0, 0).backward()
        o.step()
    assert torch.equal(flat_params(model), flat_params(twin))
    assert not step.compressing(1) and step.compressing(2) and math.isclose(step.moment_scale(2), 0.1)
    step.detach()


@pytest.mark.distributed
def test_the_one_line_with_adamw_measures_its_dense_warm_up(one_process_group):
    """``register_comm_hook(ddp, name, optimizer=adamw)`` and nothing else: it runs, its warm-up
    measured (tests/hook/test_adam_warmup.py), and the dense steps before the first possible
    end (two windows) are stock DDP + AdamW (same run, same data)."""
    runs = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = DDP(make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if hooked:
            state = gradsift.register_comm_hook(model, "topk", ratio=0.1, optimizer=optimizer)
            assert state.options.warmup_steps is None and state.adam.warmup_end is None
        generator = torch.Generator().manual_seed(5)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, IN, generator=generator)).square().mean().backward()
            optimizer.step()
        runs[hooked] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(runs[False], runs[True])
    explicit = DDP(make_model())
    kept = gradsift.register_comm_hook(
        explicit, "topk", ratio=0.1, optimizer=torch.optim.AdamW(explicit.parameters()), warmup_steps=7
    )
    assert kept.options.warmup_steps == 7


class _Adapter(torch.nn.Module):
    """A LoRA-like adapter ``x A^T B^T`` with ``B`` zero: ``A``'s gradient is zero until ``B`` moves,
    and ``B`` is kept at zero here (``lr`` 0 in its group), so ``A``'s never moves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.zeros(8, 4))
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + x @ self.a.T @ self.b.T


def test_a_parameter_the_warm_up_never_moved_steps_by_the_models_largest_root(one_process_group):
    """Its second moment is all zeros, so ``m / D`` with ``D = eps`` would be ``m / eps``: its
    preconditioner is the model's largest root instead, the smallest step the method takes
    anywhere -- computed here from the optimizer's state at the freeze, an independent oracle."""
    model = _Adapter()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(
        [{"params": [model.a, *model.head.parameters()]}, {"params": [model.b], "lr": 0.0}], lr=LR
    )
    state = gradsift.register_comm_hook(ddp, "topk", ratio=1.0, warmup_steps=2, momentum_masking=False)
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for step in range(6):
        optimizer.zero_grad()
        (ddp(inputs) - inputs).square().mean().backward()
        if step == 2:  # the freeze: the model's largest bias-corrected root, by hand
            roots = [
                (s["exp_avg_sq"] / (1 - 0.999 ** float(s["step"]))).sqrt().max()
                for s in optimizer.state.values()
            ]
            largest = float(max(roots))
        optimizer.step()
    assert float(optimizer.state[model.a]["exp_avg_sq"].abs().max()) == 0.0  # never moved in the warm-up
    preconditioner = state.adam._preconditioners[id(model.a)]
    assert torch.allclose(preconditioner, torch.full_like(preconditioner, largest + 1e-8), rtol=1e-6)
    assert torch.isfinite(model.a).all() and torch.equal(model.b, torch.zeros(8, 4))


def _unfrozen_at(step_unfrozen: int, warmup_steps: int, steps: int) -> torch.nn.Module:
    """A model whose first layer is frozen after DDP is built (``find_unused_parameters=True``) and
    unfrozen at ``step_unfrozen``, trained with AdamW under ``topk`` with a fixed warm-up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DDP(model, find_unused_parameters=True)
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    gradsift.register_comm_hook(ddp, "topk", optimizer=optimizer, ratio=0.25, warmup_steps=warmup_steps)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step == step_unfrozen:
            model[0].requires_grad_(True)
        optimizer.zero_grad()
        ddp(torch.randn(16, 8, generator=generator)).square().mean().backward()
        optimizer.step()
    return model


def test_a_parameter_unfrozen_after_the_warm_up_is_refused_naming_it(one_process_group):
    """Frozen through the dense warm-up, a parameter has no second moment for the frozen
    preconditioner: its first compressed step is refused, naming the unfreezing and what works;
    unfrozen during the warm-up, Adam's own steps give it one and it trains on."""
    with pytest.raises(
        InvalidOptionError, match="without a second moment.*unfrozen since.*before the warm-up"
    ):
        _unfrozen_at(step_unfrozen=5, warmup_steps=3, steps=7)
    model = _unfrozen_at(step_unfrozen=1, warmup_steps=3, steps=7)
    torch.manual_seed(0)
    assert not torch.equal(model[0].weight, torch.nn.Linear(8, 16).weight)  # it trained


def test_an_element_the_warm_up_seldom_saw_is_preconditioned_by_its_tensors_floor(one_process_group):
    """An input feature a thousand times smaller than the others gives its weights a second moment
    a million times smaller: at the freeze their preconditioner is a hundredth of the tensor's
    root-mean-square root instead of their own root, the others' are their own -- the freeze written
    out from the optimizer's state (``frozen_variance_start``), and the floor checked to bind there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    state = gradsift.register_comm_hook(ddp, "topk", ratio=1.0, warmup_steps=3, momentum_masking=False)
    generator = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-3] + [1.0] * 7)
    for step in range(5):
        optimizer.zero_grad()
        ddp(torch.randn(16, 8, generator=generator) * scale).square().mean().backward()
        if step == 3:  # the freeze
            _, expected = frozen_variance_start(optimizer, [model.weight], (0.9, 0.999))
            s = optimizer.state[model.weight]
            root = (s["exp_avg_sq"] / (1 - 0.999 ** float(s["step"]))).sqrt()
        optimizer.step()
    floor = 0.01 * float(root.pow(2).mean()) ** 0.5
    assert bool((root[:, 0] < floor).all())  # the floor binds on feature 0
    assert bool((root[:, 1:] > floor).all())  # and on nothing else
    preconditioner = state.adam._preconditioners[id(model.weight)]
    assert torch.allclose(preconditioner, expected[model.weight], rtol=1e-5)
    assert torch.allclose(preconditioner[:, 0], torch.full((4,), floor + 1e-8), rtol=1e-5)


@pytest.mark.distributed
def test_a_relu_mlps_weights_stay_near_stock_adamws_under_the_1_bit_adam_method(one_process_group):
    """A ReLU MLP under the 1-bit Adam method (``efsignsgd``, AdamW): units that seldom fired during
    the dense warm-up froze a tiny second moment, and ``1 / D`` multiplied the sign code's
    bucket-wide magnitude there. With the floor the largest weight stays within 50x stock AdamW's
    on the same data: a threshold between the spreads over seeds 0-2 with the floor and without it
    (docs/decisions.md, "A floor under the frozen Adam root")."""

    def largest_weight(hooked: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(128, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
        ddp = DDP(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if hooked:
            gradsift.register_comm_hook(ddp, "efsignsgd", optimizer=optimizer, warmup_steps=40)
        data, teacher = (
            torch.Generator().manual_seed(0),
            torch.randn(128, 10, generator=torch.Generator().manual_seed(7)),
        )
        for _ in range(220):
            x = torch.randn(32, 128, generator=data)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(1)).backward()
            optimizer.step()
        return max(float(p.detach().abs().max()) for p in model.parameters())

    hooked, stock = largest_weight(hooked=True), largest_weight(hooked=False)
    assert hooked <= 50 * stock, (hooked, stock)
