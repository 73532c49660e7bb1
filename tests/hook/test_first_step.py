"""The hook's checks at the first optimizer step (gradsift.hook.first_step), on a 1-rank gloo
group in this process: a GradScaler used without ``scaler=`` is refused at its first
step, a momentum optimizer not passed as ``optimizer=`` is named in a warning, and
neither fires for the right setup or for a user's own gradient clipping; clipping after the
exchange under SGD's momentum correction is refused where it binds."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook import first_step
from gradsift.hook.before_step import BEFORE_STEP

pytestmark = pytest.mark.distributed


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))


def train(ddp: DDP, optimizer, scaler=None, steps: int = 3, clip: float | None = None) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ddp(torch.randn(8, 32, generator=generator)).square().mean()
        if scaler is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            optimizer.step()
            continue
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()


def test_a_grad_scaler_the_hook_cannot_adopt_is_refused_at_the_first_step(one_process_group):
    """Two enabled scalers have scaled a loss: discovery adopts neither (which scales this
    model's loss is not knowable), and the first step's check refuses the scaled gradients."""
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    gradsift.register_comm_hook(ddp, "topk", ratio=0.5, optimizer=optimizer)
    other = torch.amp.GradScaler("cpu", init_scale=2.0**3)
    other.scale(torch.ones(()))
    before = [p.detach().clone() for p in ddp.parameters()]
    with pytest.raises(InvalidOptionError, match=r"2\^12.*scaler="):
        train(ddp, optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**12))
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True))  # not stepped


@pytest.mark.parametrize("compressor", ["topk", "sidco-exp", "qsgd"])
def test_the_scaler_passed_or_plain_gradients_or_user_clipping_train_silently(one_process_group, compressor):
    """Under momentum correction (``topk``, ``sidco-exp``) the clipping here never binds; ``qsgd``
    takes no momentum over, so its clipping acts on the gradient as with stock DDP."""
    for setup in ("scaler", "plain", "clipped"):
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if setup == "scaler" else None
        state = gradsift.register_comm_hook(ddp, compressor, optimizer=optimizer, scaler=scaler)
        clip = (1e-3 if compressor == "qsgd" else 1e6) if setup == "clipped" else None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(ddp, optimizer, scaler, clip=clip)
        checks = state.first_step
        assert not checks.check_momentum and not checks.check_scaler, setup  # decided
        assert checks.watching == (compressor != "qsgd"), setup  # the clipping watch goes on


@pytest.mark.parametrize("compressor", ["topk", "sidco-exp"])
@pytest.mark.parametrize("with_scaler", [False, True], ids=["plain", "scaler-unscaled"])
def test_clipping_after_the_exchange_under_momentum_correction_is_refused(
    one_process_group, compressor, with_scaler
):
    """``clip_grad_norm_`` between backward and the step scales the velocity momentum correction
    sends: where it binds, refused at the second such step (the first factor could be a constant
    rescale), before the optimizer steps (after a scaler's ``unscale_`` too: its power of two is
    not what is refused); without a takeover (SGD without momentum) and under the Adam method
    (whose clipped first moment is measured at parity) it trains."""
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if with_scaler else None
    state = gradsift.register_comm_hook(ddp, compressor, ratio=0.5, optimizer=optimizer, scaler=scaler)
    with pytest.raises(
        InvalidOptionError,
        match=r"hook's times [\d.e-]+, not a power of two.*clipping after backward.*clip_norm=C",
    ):
        train(ddp, optimizer, scaler, clip=1e-3)
    assert state.step == 2  # refused at the second step's optimizer step
    for make, options in (
        (lambda p: torch.optim.SGD(p, lr=0.05), {}),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), {"warmup_steps": 1}),
    ):
        ddp = model()
        optimizer = make(ddp.parameters())
        gradsift.register_comm_hook(ddp, compressor, ratio=0.5, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(ddp, optimizer, clip=1e-3)


@pytest.mark.parametrize("with_scaler", [False, True], ids=["plain", "scaler-unscaled"])
def test_value_clipping_after_the_exchange_under_momentum_correction_is_refused(
    one_process_group, with_scaler
):
    """``clip_grad_value_`` clamps the velocity momentum correction sends: where it cuts an element,
    refused at that step (after a scaler's ``unscale_`` too); a bound that cuts nothing trains."""

    def clamped(ddp, optimizer, scaler, value: float) -> None:
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            optimizer.zero_grad()
            loss = ddp(torch.randn(8, 32, generator=generator)).square().mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_value_(ddp.parameters(), value)
            optimizer.step() if scaler is None else (scaler.step(optimizer), scaler.update())

    for value, refused in ((1e-4, True), (1e6, False)):
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if with_scaler else None
        state = gradsift.register_comm_hook(ddp, "topk", ratio=0.5, optimizer=optimizer, scaler=scaler)
        if refused:
            with pytest.raises(InvalidOptionError, match=r"clamped to \+-0\.0001: clipping after backward"):
                clamped(ddp, optimizer, scaler, value)
            assert state.step == 1  # refused at the first step's optimizer step
        else:
            clamped(ddp, optimizer, scaler, value)


def test_a_constant_rescale_after_the_exchange_is_exact_and_left_alone(one_process_group, monkeypatch):
    """A script that divides the gradients by its accumulation steps after backward: one constant
    factor, linear, so under momentum correction with nothing dropped the run is stock DDP's with
    the same rescale, and the clipping watch never refuses it."""
    monkeypatch.setattr(first_step, "CLIPPING_CHECKS", 6)

    def run(hooked: bool) -> list[torch.Tensor]:
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        generator = torch.Generator().manual_seed(1)
        for _ in range(6):
            optimizer.zero_grad()
            ddp(torch.randn(8, 32, generator=generator)).square().mean().backward()
            for param in ddp.parameters():
                param.grad.div_(3)
            optimizer.step()
        return [p.detach().clone() for p in ddp.parameters()]

    for hooked, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
    ],
    ids=["sgd-momentum", "adamw"],
)
def test_a_momentum_optimizer_the_hook_cannot_adopt_is_named_once(one_process_group, make_optimizer):
    """A second optimizer holds the model's parameters: discovery adopts neither, and the
    first step's check names the one that steps."""
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    spare = torch.optim.SGD(ddp.parameters(), lr=0.0)
    gradsift.register_comm_hook(ddp, "randomk", ratio=0.1)
    with pytest.warns(UserWarning, match=f"{type(optimizer).__name__}.*optimizer=") as caught:
        train(ddp, optimizer, steps=3)
    assert len([w for w in caught if "optimizer=" in str(w.message)]) == 1
    del spare


def test_a_sharded_optimizer_is_named_with_what_works_instead(one_process_group):
    """``ZeroRedundancyOptimizer`` (ZeRO-1) shards the state the hook would take over: unpassed, the
    first step's warning names the compressors without error feedback rather than ``optimizer=``;
    passed, the refusal says why."""
    with warnings.catch_warnings():  # its module's torch.jit.interface is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = model()
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9
    )
    gradsift.register_comm_hook(ddp, "randomk", ratio=0.1)
    with pytest.warns(
        UserWarning, match="ZeroRedundancyOptimizer .*without error feedback \\(none, fp16, bf16"
    ):
        train(ddp, optimizer, steps=2)
    ddp = model()
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9
    )
    with pytest.raises(
        InvalidOptionError, match="shards the state the hook would take over.*optimizer=False"
    ):
        gradsift.register_comm_hook(ddp, "randomk", ratio=0.1, optimizer=optimizer)


def test_no_warning_without_momentum_or_without_error_feedback(one_process_group):
    for compressor, momentum in (("randomk", 0.0), ("none", 0.9)):
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
        gradsift.register_comm_hook(ddp, compressor) if compressor == "none" else gradsift.register_comm_hook(
            ddp, compressor, ratio=0.1
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(ddp, optimizer)


def test_an_optimizer_of_other_parameters_is_not_checked(one_process_group):
    ddp = model()
    gradsift.register_comm_hook(ddp, "randomk", ratio=0.1)
    other = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD([*ddp.parameters()], lr=0.05)
    unrelated = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
    other(torch.randn(2, 3)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unrelated.step()
        train(ddp, optimizer)


def test_several_hooked_models_step_side_by_side(one_process_group, monkeypatch):
    """Each decided check leaves the optimizers' global hook table alone while a step iterates
    over it (removing itself there raised 'OrderedDict mutated during iteration')."""
    monkeypatch.setattr(first_step, "CLIPPING_CHECKS", 2)  # the clipping watch ends within the steps
    runs = []
    for _ in range(3):
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        runs.append(
            (gradsift.register_comm_hook(ddp, "topk", ratio=0.5, optimizer=optimizer), ddp, optimizer)
        )
    for _ in range(3):
        for _, ddp, optimizer in runs:
            train(ddp, optimizer, steps=1)
    assert not any(state.first_step.watching for state, _, _ in runs)
    assert not any(BEFORE_STEP.holds(state.first_step) for state, _, _ in runs)


class Wrapped(torch.optim.Optimizer):
    """A wrapper in the manner of Accelerate's ``AcceleratedOptimizer``: its step steps the
    inner optimizer, whose param groups it shares."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # no super().__init__: as Accelerate
        self.optimizer = inner

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_a_wrapper_passed_as_optimizer_is_not_warned_about(one_process_group):
    ddp = model()
    optimizer = Wrapped(torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    state = gradsift.register_comm_hook(ddp, "randomk", ratio=0.1, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(ddp, optimizer)
    assert state.feedback.momentum == 0.9  # taken over through the wrapper
