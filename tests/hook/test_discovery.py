"""Discovery (gradsift.hook.discovery): the hook adopts the optimizer and the GradScaler a
training script built but did not pass, and a run with discovery equals, bit for bit, the
same run with them passed by hand -- per optimizer family and for the scaler, on a 1-rank
gloo group in this process (the arithmetic of every rank's route)."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook import discovery
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state
from support.steps import backward_and_step

pytestmark = pytest.mark.distributed


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def run(compressor: str, family: str, *, passed: bool, scaler_scale: float | None = None, **options):
    """Six steps of a fixed data stream; the final parameters and the hook's state."""
    ddp = model()
    optimizer = OPTIMIZERS[family](ddp.parameters())
    scaler = None if scaler_scale is None else torch.amp.GradScaler("cpu", init_scale=scaler_scale)
    given = {"optimizer": optimizer, "scaler": scaler} if passed else {}
    state = gradsift.register_comm_hook(ddp, compressor, **options, **given)
    generator = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # adopted: no "not passed" warning
        for _ in range(6):
            optimizer.zero_grad()
            backward_and_step(
                ddp(torch.randn(16, 32, generator=generator)).square().mean(), optimizer, scaler
            )
    return [p.detach().clone() for p in ddp.parameters()], state


CASES = [
    ("topk", "sgd-momentum", {"ratio": 0.2}),
    ("randomk", "sgd-momentum", {"ratio": 0.2}),
    ("sidco-exp", "sgd-momentum", {"ratio": 0.05}),
    ("topk", "sgd", {"ratio": 0.2}),
    ("efsignsgd", "adamw", {"warmup_steps": 2}),
    ("topk", "adam", {"ratio": 0.2, "warmup_steps": 2}),
    ("efsignsgd", "adamw", {"warmup_steps": 2, "adam": "onebit"}),
]


@pytest.mark.parametrize(("compressor", "family", "options"), CASES, ids=lambda c: str(c))
def test_a_found_optimizer_trains_as_the_one_passed(one_process_group, compressor, family, options):
    found, state = run(compressor, family, passed=False, **options)
    given, _ = run(compressor, family, passed=True, **options)
    assert state.optimizer is not None  # adopted
    for a, b in zip(found, given, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compressor", gradsift.available_compressors())
def test_every_compressor_with_a_found_optimizer_and_scaler_trains_as_with_them_passed(
    one_process_group, compressor
):
    """SGD momentum and a GradScaler, neither passed: the run equals the one with both passed."""
    options = {"threshold": 0.01} if compressor == "threshold" else {}  # its one required option
    found, state = run(compressor, "sgd-momentum", passed=False, scaler_scale=2.0**10, **options)
    given, _ = run(compressor, "sgd-momentum", passed=True, scaler_scale=2.0**10, **options)
    assert state.options.scaler is not None and state.optimizer is not None
    for a, b in zip(found, given, strict=True):
        assert torch.equal(a, b)


def test_a_found_optimizer_is_the_inner_one_of_a_wrapper():
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # shares the inner's groups, as Accelerate's does
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    outer = Wrapper(inner)
    params = inner.param_groups[0]["params"]
    assert discovery.find(params, scaler=False)[0] is inner
    del outer


def test_nothing_is_adopted_when_two_optimizers_hold_the_parameters():
    layer = torch.nn.Linear(2, 2)
    first = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert discovery.find(layer.parameters(), scaler=False)[0] is first
    second = torch.optim.Adam(layer.parameters(), lr=0.1)
    assert discovery.find(layer.parameters(), scaler=False)[0] is None
    assert discovery.find(torch.nn.Linear(2, 2).parameters(), scaler=False)[0] is None  # holds none of them
    del second


def test_a_scaler_that_scaled_nothing_or_is_disabled_is_not_adopted():
    gc.collect()  # scalers of earlier tests
    assert discovery.find(None, scaler=True)[1] is None
    idle = torch.amp.GradScaler("cpu")
    off = torch.amp.GradScaler("cpu", enabled=False)
    off.scale(torch.ones(()))
    assert discovery.find(None, scaler=True)[1] is None
    idle.scale(torch.ones(()))
    assert discovery.find(None, scaler=True)[1] is idle
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert discovery.find(model.parameters(), scaler=True) == (optimizer, idle)  # both in one walk
    assert discovery.find(model.parameters(), scaler=False) == (optimizer, None)


@pytest.mark.parametrize("compressor", ["topk", "sidco-exp"])
def test_an_earlier_runs_scaler_still_alive_is_not_taken_for_this_ones(one_process_group, compressor):
    """A notebook's ``scaler`` of an earlier AMP run, alive when a run without AMP registers the
    hook: adopting it scaled the hook's weight decay by 2^16 and the run diverged (NaN); now the
    run equals the one with no scaler alive, bit for bit."""
    gc.collect()  # scalers of earlier tests
    alone, _ = run(compressor, "sgd-momentum", passed=False, ratio=0.2)
    earlier = torch.amp.GradScaler("cpu")
    earlier.scale(torch.ones(()))  # its scale exists: it scaled a loss
    beside, state = run(compressor, "sgd-momentum", passed=False, ratio=0.2)
    assert state.options.scaler is None and state.optimizer is not None  # the optimizer found, not it
    assert all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))
    later = torch.amp.GradScaler("cpu")  # a scaler that first scales after the registration is found
    state = gradsift.register_comm_hook(model(), compressor, ratio=0.2)
    later.scale(torch.ones(()))
    assert discovery.find(None, scaler=True, earlier=state.earlier_scalers)[1] is later
    assert discovery.find(None, scaler=True)[1] is None  # both count where the earlier one is not known


def test_an_explicit_warmup_of_zero_under_frozen_adam_is_refused(one_process_group):
    ddp = model()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    with pytest.raises(InvalidOptionError, match="warmup_steps=0.*no second moment"):
        gradsift.register_comm_hook(ddp, "efsignsgd", optimizer=optimizer, warmup_steps=0)


def test_a_misspelt_option_lists_the_hooks_and_the_compressors(one_process_group):
    with pytest.raises(
        InvalidOptionError, match=r"warmup_step\b.*hook's options are.*warmup_steps.*'topk'.*ratio"
    ):
        gradsift.register_comm_hook(model(), "topk", warmup_step=3)


def closure_steps(ddp: DDP, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` of ``optimizer.step(closure)`` on a fixed data stream, the closure's backward
    inside the step (as ``LBFGS`` needs)."""
    generator = torch.Generator().manual_seed(3)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ddp(torch.randn(16, 32, generator=generator)).square().mean()
        loss.backward()
        return loss

    for _ in range(steps):
        optimizer.step(closure)


@pytest.mark.parametrize(
    ("make_optimizer", "warned"),
    [
        (lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=2), False),
        (lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9), True),
    ],
    ids=["lbfgs", "rmsprop-momentum"],
)
def test_a_found_optimizer_of_a_kind_no_method_takes_over_is_named_not_refused(
    one_process_group, make_optimizer, warned
):
    """A named error-feedback method and an optimizer the hook cannot take over (neither SGD nor
    the Adam family), never passed: discovery leaves it, so nothing refuses an ``optimizer=`` the
    script never wrote; the first step's check names one with a momentum (and the compressors
    without error feedback), as for an optimizer not found. Stepped through a closure too."""
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    state = gradsift.register_comm_hook(ddp, "topk", ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        closure_steps(ddp, optimizer, 3)
    named = [str(w.message) for w in caught if "without error feedback" in str(w.message)]
    assert state.optimizer is None and len(named) == (1 if warned else 0), named


def test_a_closure_steps_as_a_loop_does_and_warns_nothing(one_process_group):
    """``optimizer.step(closure)``: the optimizer's step pre-hook runs before the closure's
    backward, the first one before anything was found; the first step's check waits for an
    exchange, so the optimizer found in that backward is not reported as not passed, and with
    nothing dropped the run equals stock DDP's."""

    def run(hooked: bool) -> list[torch.Tensor]:
        ddp = model()
        optimizer = OPTIMIZERS["sgd-momentum"](ddp.parameters())
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            closure_steps(ddp, optimizer, 4)
        return [p.detach().clone() for p in ddp.parameters()]

    for hooked, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compressor", ["topk", "sidco-exp", "auto"])
def test_a_found_scaler_resumes_through_the_documented_helpers(one_process_group, compressor):
    """Neither the optimizer nor the ``GradScaler`` passed: a checkpoint written with
    ``gather_hook_states`` after 3 steps and loaded with ``load_hook_state`` into fresh objects
    (the scaler not yet found there) repeats the uninterrupted run's last 3 steps bit for bit.
    Before, ``load_hook_state`` refused it: "scaler: <GradScaler> in the checkpoint, null in
    this hook"."""

    def fresh():
        ddp = model()
        optimizer = OPTIMIZERS["sgd-momentum"](ddp.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        options = {} if compressor == "auto" else {"ratio": 0.2, "warmup_steps": 1}
        return ddp, optimizer, scaler, gradsift.register_comm_hook(ddp, compressor, **options)

    def steps(built, first: int, stop: int) -> None:
        ddp, optimizer, scaler, _ = built
        for step in range(first, stop):
            inputs = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            backward_and_step(ddp(inputs).square().mean(), optimizer, scaler)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's notes on a one-rank group
        built = fresh()
        steps(built, 0, 3)
        saved = copy.deepcopy({
            "model": built[0].state_dict(), "optimizer": built[1].state_dict(),
            "scaler": built[2].state_dict(), "hook": gather_hook_states(built[3]),
        })  # fmt: skip
        steps(built, 3, 6)
        again = fresh()
        again[0].load_state_dict(saved["model"])
        again[1].load_state_dict(saved["optimizer"])
        again[2].load_state_dict(saved["scaler"])
        load_hook_state(again[3], saved["hook"], device="cpu")
        steps(again, 3, 6)
    for ours, theirs in zip(again[0].parameters(), built[0].parameters(), strict=True):
        assert torch.equal(ours, theirs)
