"""The checks at each step of an optimizer whose momentum the hook took over (gradsift.hook.taken_over).

In one process on a world-size-1 gloo group: gradient accumulation without ``no_sync`` under
momentum correction (SGD) and under the Adam method is refused at the optimizer's step,
naming the count; with ``no_sync`` it trains; error feedback without a momentum taken over
(SGD without momentum) and stock DDP's own allreduce are not checked (exact by linearity, and
mass-conserving); a step the ``GradScaler`` skips for an overflow is no exchange. A scheduler
that cycles the momentum the hook takes over (``OneCycleLR``'s default) is refused at the
takeover, or at the next step when built after it; with ``cycle_momentum=False`` it trains. An optimizer restored without the hook's state is
warned about at its first step.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError

MICRO = 3


def accumulate(ddp, optimizer, steps: int, *, no_sync: bool, scaler=None, scale_first: float = 1.0) -> None:
    """``steps`` optimizer steps of ``MICRO`` micro-batches each."""
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(MICRO):
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + micro))
            syncing = not no_sync or micro == MICRO - 1
            with contextlib.nullcontext() if syncing else ddp.no_sync():
                loss = (ddp(inputs) - inputs[:, :4]).square().mean() / MICRO
                (
                    loss if scaler is None else scaler.scale(loss * (scale_first if step == 0 else 1.0))
                ).backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()


#: A method that takes the momentum over, per optimizer family: SGD's and AdamW's.
EACH_TAKEOVER = pytest.mark.parametrize(
    ("compressor", "make_optimizer", "options"),
    [
        ("topk", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), {"ratio": 0.1}),
        ("efsignsgd", lambda p: torch.optim.AdamW(p, lr=1e-3), {"warmup_steps": 1}),
    ],
    ids=["sgd-momentum", "adamw"],
)


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))


@EACH_TAKEOVER
def test_accumulation_without_no_sync_is_refused_at_the_optimizers_step(
    one_process_group, compressor, make_optimizer, options
):
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    gradsift.register_comm_hook(ddp, compressor, **options)
    with pytest.raises(
        InvalidOptionError, match=rf"^{MICRO} exchanges of the hook's gradients .*no_sync\(\)"
    ):
        accumulate(ddp, optimizer, 1, no_sync=False)
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    state = gradsift.register_comm_hook(ddp, compressor, **options)
    accumulate(ddp, optimizer, 4, no_sync=True)
    assert state.step == 4


@pytest.mark.parametrize(
    ("compressor", "momentum"), [("topk", 0.0), ("none", 0.9)], ids=["no-momentum", "stock-allreduce"]
)
def test_without_a_momentum_taken_over_accumulation_is_left_alone(one_process_group, compressor, momentum):
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
    state = gradsift.register_comm_hook(ddp, compressor)
    accumulate(ddp, optimizer, 3, no_sync=False)
    assert state.step == 3 * MICRO and state.taken_over is None


def test_a_step_the_scaler_skips_is_no_exchange(one_process_group):
    """The first step's loss is scaled past float32's range: every micro-batch's exchange is
    non-finite and dropped, the scaler skips the optimizer's step; the next steps, one kept
    exchange each, pass."""
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = gradsift.register_comm_hook(ddp, "topk", ratio=0.1)
    accumulate(ddp, optimizer, 4, no_sync=True, scaler=scaler, scale_first=1e38)
    assert state.telemetry.summary()["total"]["skipped_steps"] == 1 and state.step == 3


@pytest.mark.parametrize(
    ("make_optimizer", "cycled"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), "SGD's momentum"),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "AdamW's first beta (betas[0])"),
    ],
    ids=["sgd-momentum", "adamw"],
)
def test_a_scheduler_cycling_the_momentum_taken_over_is_refused(one_process_group, make_optimizer, cycled):
    """Built before the hook finds the optimizer, the cycling scheduler is refused at the
    takeover, in the first backward, before any optimizer step (the parameters as built);
    built after ``optimizer=`` was taken over at registration, at the first optimizer step (the
    scheduler's constructor set its ``max_momentum``), before the step moves a parameter, in
    the optimizer's own word for the momentum; ``cycle_momentum=False`` trains."""
    word = cycled.split("'s ", 1)[1]
    orders = [  # optimizer= at registration, what the refusal says, the hook's steps before it
        (False, rf"a scheduler cycles {re.escape(cycled)} ", 0),
        (True, rf"the optimizer's {re.escape(word)} became ", 1),  # the scheduler set max_momentum when built
    ]
    for cycle_momentum in (True, False):
        for at_registration, message, refused_at in orders:
            ddp = model()
            initial = [p.detach().clone() for p in ddp.parameters()]
            optimizer = make_optimizer(ddp.parameters())
            passed = {"optimizer": optimizer} if at_registration else {}
            state = gradsift.register_comm_hook(ddp, "topk", ratio=0.1, warmup_steps=1, **passed)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.05, total_steps=10, cycle_momentum=cycle_momentum
            )
            refused = pytest.raises(InvalidOptionError, match=message + ".*cycle_momentum=False")
            with refused if cycle_momentum else contextlib.nullcontext():
                for _ in range(4):
                    accumulate(ddp, optimizer, 1, no_sync=True)
                    scheduler.step()
            assert state.step == (refused_at if cycle_momentum else 4)
            if cycle_momentum:  # refused before the step moved a parameter
                assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), initial, strict=True))


@EACH_TAKEOVER
def test_an_optimizer_restored_without_the_hooks_state_is_warned_about(
    one_process_group, compressor, make_optimizer, options
):
    """A script that checkpoints the model and the optimizer but not the hook: resumed so, the
    hook's velocity and residuals start from zero and the run departs from the uninterrupted
    one -- warned at the first step, naming both step counts; resumed with the hook's state
    too, it continues bit for bit and nothing is warned."""

    def start():
        ddp = model()
        optimizer = make_optimizer(ddp.parameters())
        return ddp, optimizer, gradsift.register_comm_hook(ddp, compressor, **options)

    ddp, optimizer, state = start()
    accumulate(ddp, optimizer, 3, no_sync=True)
    saved = copy.deepcopy((ddp.module.state_dict(), optimizer.state_dict(), state.state_dict()))
    accumulate(ddp, optimizer, 2, no_sync=True)
    uninterrupted = [p.detach().clone() for p in ddp.parameters()]

    for with_hook_state in (True, False):
        ddp, optimizer, state = start()
        ddp.module.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        if with_hook_state:
            state.load_state_dict(saved[2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accumulate(ddp, optimizer, 2, no_sync=True)
        messages = [str(w.message) for w in caught if str(w.message).startswith("gradsift:")]
        same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), uninterrupted, strict=True))
        if with_hook_state:
            assert messages == [] and same
        else:
            assert len(messages) == 1 and not same
            assert "saved at the hook's step 3" in messages[0] and "the hook is at step 1" in messages[0]
            assert "load_hook_state" in messages[0]


def test_an_optimizer_checkpoint_saved_without_gradsift_loads_before_the_takeover(one_process_group):
    """A checkpoint of stock DDP's SGD (momentum buffers, ``momentum=0.9`` in its groups), loaded
    into a run with the hook: found at the first backward, after the load, the momentum is taken
    over from the loaded buffers -- with nothing dropped (ratio 1, no masking) the run continues as
    stock DDP does from that checkpoint --; loaded after ``register_comm_hook(..., optimizer=)``
    took the momentum over, it would apply momentum twice, and is refused naming the order."""

    def sgd(ddp):
        return torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)

    stock = model()
    optimizer = sgd(stock)
    accumulate(stock, optimizer, 3, no_sync=True)
    saved = copy.deepcopy((stock.module.state_dict(), optimizer.state_dict()))
    accumulate(stock, optimizer, 3, no_sync=True)

    dense = {"ratio": 1.0, "momentum_masking": False}
    ddp = model()
    optimizer = sgd(ddp)
    gradsift.register_comm_hook(ddp, "topk", **dense)
    ddp.module.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    accumulate(ddp, optimizer, 3, no_sync=True)
    for hooked, plain in zip(ddp.parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)

    ddp = model()
    optimizer = sgd(ddp)
    gradsift.register_comm_hook(ddp, "topk", optimizer=optimizer, **dense)
    optimizer.load_state_dict(saved[1])
    with pytest.raises(
        InvalidOptionError, match=r"groups were replaced .* load the optimizer before register_comm_hook"
    ):
        accumulate(ddp, optimizer, 1, no_sync=True)


def test_a_weight_decay_schedule_is_followed_before_each_exchange(one_process_group):
    """A script that sets SGD's ``weight_decay`` again mid-run (here at step 3, per group): the
    hook, which took the decay over, takes the new value before that step's exchange, so with
    nothing dropped the run is stock DDP's with the same schedule (SGD adding it on top of the
    hook's old one would decay twice)."""

    def run(hooked: bool) -> list[torch.Tensor]:
        ddp = model()
        weights = [p for p in ddp.parameters() if p.ndim == 2]
        biases = [p for p in ddp.parameters() if p.ndim == 1]
        optimizer = torch.optim.SGD(
            [{"params": weights, "weight_decay": 5e-3}, {"params": biases, "weight_decay": 0.0}],
            lr=0.05,
            momentum=0.9,
        )
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        for step in range(6):
            if step == 3:
                optimizer.param_groups[0]["weight_decay"] = 5e-2
            accumulate(ddp, optimizer, 1, no_sync=True)
        return [p.detach().clone() for p in ddp.parameters()]

    for hooked, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)


def test_adams_l2_decay_set_after_the_takeover_is_followed(one_process_group):
    """Adam (not AdamW) keeps its L2 ``weight_decay`` in its groups and the frozen-variance method
    adds the hook's copy of it to the gradient in compressed steps: a decay the script sets after
    ``register_comm_hook(..., optimizer=)`` took the copy reaches those steps as if the optimizer
    had been built with it (bit for bit)."""

    def run(set_after: bool) -> list[torch.Tensor]:
        ddp = model()
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3, weight_decay=0.0 if set_after else 1e-2)
        gradsift.register_comm_hook(ddp, "efsignsgd", optimizer=optimizer, warmup_steps=1)
        if set_after:
            optimizer.param_groups[0]["weight_decay"] = 1e-2
        accumulate(ddp, optimizer, 4, no_sync=True)
        return [p.detach().clone() for p in ddp.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


def head_then_body(ddp, momentum: float = 0.9):
    """SGD on the last layer, with the first layer's group to add later (a fine-tuning unfreeze)."""
    head, body = list(ddp.module[2].parameters()), list(ddp.module[0].parameters())
    optimizer = torch.optim.SGD(head, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return optimizer, {"params": body, "lr": 0.02, "momentum": momentum, "weight_decay": 5e-3}


def step_with_closure(ddp, optimizer, step: int) -> None:
    """One optimizer step whose forward and backward run in its closure (LBFGS's and Lightning's
    way): the optimizer's step pre-hooks run before the step's exchange."""
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (ddp(inputs) - inputs[:, :4]).square().mean()
        loss.backward()
        return loss

    optimizer.step(closure)


@pytest.mark.parametrize("closure", [False, True], ids=["plain", "closure"])
def test_a_parameter_group_added_mid_run_is_taken_over_before_its_first_exchange(one_process_group, closure):
    """The hook's velocity ran over the body while no group held it; SGD starts the added
    group's momentum buffers empty. With nothing dropped (ratio 1, no masking), the run with
    the one line equals stock DDP's with the same ``add_param_group`` at step 3 -- the group's
    momentum and weight decay moved into the hook, the body's velocity zeroed before the
    step's exchange (without that zeroing it ends 2.5e-2 away). Stepping with a closure, the
    optimizer's pre-hooks see the added group before the closure's backward follows it (it
    was refused there as added after backward, Lightning's ``BaseFinetuning`` the case)."""

    def run(hooked: bool) -> list[torch.Tensor]:
        ddp = model()
        optimizer, body = head_then_body(ddp)
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        for step in range(7):
            if step == 3:
                optimizer.add_param_group(body)
            if closure:
                step_with_closure(ddp, optimizer, step)
            else:
                accumulate(ddp, optimizer, 1, no_sync=True)
        return [p.detach().clone() for p in ddp.parameters()]

    hooked, stock = run(True), run(False)
    assert not torch.equal(stock[0], model().module[0].weight)  # the body trained
    for a, b in zip(hooked, stock, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["sgd-momentum", "adamw"])
@pytest.mark.parametrize("optimizer_passed", [True, False], ids=["optimizer-passed", "discovered"])
def test_a_run_with_an_added_group_resumes_bit_for_bit(one_process_group, optimizer_passed, family):
    """Saved after the body's group was added (under AdamW during the warm-up, saved after the
    freeze), resumed by a script that builds the head's optimizer, adds the body's group and
    loads the checkpoints: the added group carries the hook's record, so its parameters keep the
    hook state loaded (not zeroed as a new group's) and, under AdamW, the second moment loaded
    with them -- whether the hook took the optimizer over at registration or found it later."""

    def start():
        ddp = model()
        optimizer, body = head_then_body(ddp)
        options = {"ratio": 0.2}
        if family == "adamw":
            optimizer = torch.optim.AdamW(list(ddp.module[2].parameters()), lr=1e-3)
            body, options = {"params": body["params"], "lr": 1e-2}, {"warmup_steps": 3}
        passed = {"optimizer": optimizer} if optimizer_passed else {}
        compressor = "topk" if family == "sgd-momentum" else "efsignsgd"
        return ddp, optimizer, body, gradsift.register_comm_hook(ddp, compressor, **options, **passed)

    ddp, optimizer, body, state = start()
    accumulate(ddp, optimizer, 2, no_sync=True)
    optimizer.add_param_group(body)
    accumulate(ddp, optimizer, 3, no_sync=True)
    saved = copy.deepcopy((ddp.module.state_dict(), optimizer.state_dict(), state.state_dict()))
    accumulate(ddp, optimizer, 3, no_sync=True)
    uninterrupted = [p.detach().clone() for p in ddp.parameters()]

    ddp, optimizer, body, state = start()
    optimizer.add_param_group(body)
    ddp.module.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    accumulate(ddp, optimizer, 3, no_sync=True)
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), uninterrupted, strict=True))


@pytest.mark.parametrize("when", ["another momentum", "after backward"])
def test_an_added_sgd_group_the_hook_cannot_follow_is_refused_naming_add_param_group(one_process_group, when):
    ddp = model()
    optimizer, body = head_then_body(ddp, momentum=0.5 if when == "another momentum" else 0.9)
    gradsift.register_comm_hook(ddp, "topk", ratio=0.1)
    accumulate(ddp, optimizer, 2, no_sync=True)
    expected = (
        "different momenta" if when == "another momentum" else "between backward and the optimizer's step"
    )
    with pytest.raises(InvalidOptionError, match=rf"optimizer.add_param_group.*{expected}|{expected}"):
        if when == "another momentum":
            optimizer.add_param_group(body)
            accumulate(ddp, optimizer, 1, no_sync=True)
        else:
            optimizer.zero_grad()
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
            (ddp(inputs) - inputs[:, :4]).square().mean().backward()
            optimizer.add_param_group(body)
            optimizer.step()


def test_an_adam_group_added_during_the_warm_up_trains_and_after_the_freeze_is_refused(one_process_group):
    """Under the frozen-variance method a group added while the warm-up is dense gets Adam's
    moments from Adam's own steps and is stepped by the method after the freeze; one added after
    the freeze has no second moment, and is refused at its first exchange naming add_param_group."""
    for add_at, refused in ((1, False), (4, True)):
        ddp = model()
        head, body = list(ddp.module[2].parameters()), list(ddp.module[0].parameters())
        optimizer = torch.optim.AdamW(head, lr=1e-3)
        state = gradsift.register_comm_hook(ddp, "efsignsgd", optimizer=optimizer, warmup_steps=3)
        accumulate(ddp, optimizer, add_at, no_sync=True)
        optimizer.add_param_group({"params": body, "lr": 1e-2})
        if refused:
            with pytest.raises(InvalidOptionError, match=r"add_param_group .* warm-up ended: .* lack"):
                accumulate(ddp, optimizer, 1, no_sync=True)
            continue
        accumulate(ddp, optimizer, 2, no_sync=True)  # through step 2, the warm-up's last
        before = body[0].detach().clone()
        accumulate(ddp, optimizer, 3, no_sync=True)
        assert not state.warming() and state.step == 6
        assert (body[0] - before).abs().max() > 1e-3  # the method steps it at about lr a step
        assert all(torch.isfinite(p).all() for p in ddp.parameters())


def test_under_auto_an_added_group_it_cannot_follow_leaves_for_stock_ddp(one_process_group):
    """``auto`` measures on ``sidco-exp`` with SGD's momentum taken over; a group added with
    another momentum cannot be taken over: it warns naming add_param_group, gives SGD its
    momentum back and runs stock DDP from that step, the added group as built and started as SGD
    starts one -- its first step ``x - lr (g + wd x)``, no velocity or residual the hook ran over
    the body before. A group with the hook's momentum is followed, with no warning."""
    for momentum, leaves in ((0.9, False), (0.5, True)):
        ddp = model()
        optimizer, body = head_then_body(ddp, momentum=momentum)
        state = gradsift.register_comm_hook(ddp)
        accumulate(ddp, optimizer, 2, no_sync=True)
        assert state.current.taken_over is not None  # measuring on sidco-exp
        optimizer.add_param_group(body)
        weight = body["params"][0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.zero_grad()
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
            (ddp(inputs) - inputs[:, :4]).square().mean().backward()
            before = weight.detach().clone()
            optimizer.step()
        messages = [str(w.message) for w in caught if "add_param_group" in str(w.message)]
        assert bool(messages) == leaves
        if leaves:
            assert "auto runs stock DDP" in messages[0] and state.stats()["auto"]["choice"] == "none"
            assert [group["momentum"] for group in optimizer.param_groups] == [0.9, 0.5]
            torch.testing.assert_close(weight, before - 0.02 * (weight.grad + 5e-3 * before))
        else:
            assert state.stats()["auto"]["choice"] == "measuring"
            assert [group["momentum"] for group in optimizer.param_groups] == [0.0, 0.0]


@EACH_TAKEOVER
def test_an_optimizer_built_again_mid_run_is_refused_and_auto_follows_it(
    one_process_group, compressor, make_optimizer, options
):
    """A script that builds a new optimizer at step 3 (a stage with a lower learning rate): the
    hook's exchange carries the momentum it took from the first, which the new one would step
    as a gradient (and, under AdamW, never give the method its step). A named method refuses it
    at the new optimizer's first step, naming the rebuild. Under SGD ``auto``, which found the
    first optimizer itself, follows it without a warning (tests/hook/test_rebuilt.py): the
    method's hand-back goes to the first optimizer, and the measuring method runs on, the new
    optimizer's momentum taken over."""
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    gradsift.register_comm_hook(ddp, compressor, **options)
    accumulate(ddp, optimizer, 3, no_sync=True)
    with pytest.raises(InvalidOptionError, match=r"other than the one whose momentum .* built again mid-run"):
        accumulate(ddp, make_optimizer(ddp.parameters()), 1, no_sync=True)
    if compressor != "topk":
        return
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)  # measuring on sidco-exp, SGD's momentum taken over
    accumulate(ddp, optimizer, 3, no_sync=True)
    rebuilt = make_optimizer(ddp.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumulate(ddp, rebuilt, 2, no_sync=True)
    assert not [str(w.message) for w in caught if "gradsift" in str(w.message)]
    stats = state.stats()["auto"]
    assert stats["choice"] == "measuring" and stats["running"] == "sidco-exp" and stats["left"] == {}
    assert rebuilt.param_groups[0]["momentum"] == 0.0 and optimizer.param_groups[0]["momentum"] == 0.9


def test_a_frozen_parameter_takes_no_weight_decay_in_the_exchange(one_process_group):
    """A layer in SGD's groups (weight decay 1e-2) frozen by ``requires_grad_(False)`` after DDP
    was built (``find_unused_parameters=True``) for three steps, then trained: SGD skips a
    parameter without a gradient, decay included, so the hook, which folds the decay into the
    exchanged velocity, adds none for it while frozen -- with nothing dropped the run is stock
    DDP's (it ended 1.3e-4 away at wd 1e-3 over two ranks, the velocity holding the decays)."""

    def run(hooked: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        ddp = DDP(net, find_unused_parameters=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        net[0].requires_grad_(False)
        for step in range(7):
            if step == 3:
                net[0].requires_grad_(True)
            accumulate(ddp, optimizer, 1, no_sync=True)
        return [p.detach().clone() for p in ddp.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sgd_without_momentum_keeps_its_weight_decay(one_process_group):
    """SGD with weight decay and no momentum: nothing enters a momentum, so the hook takes
    nothing over and SGD decays after the exchange, as with stock DDP -- a decay schedule and
    backward passes without ``no_sync`` (each an exchange) then train as stock DDP does, with
    nothing dropped. (The hook took the decay over: the schedule decayed twice, 5.3e-4 from
    stock, and three passes a step decayed three times, 2.0e-3.)"""

    def run(hooked: bool, no_sync: bool) -> list[torch.Tensor]:
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, weight_decay=1e-2)
        if hooked:
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0)
        for step in range(6):
            if step == 3:
                optimizer.param_groups[0]["weight_decay"] = 5e-2
            accumulate(ddp, optimizer, 1, no_sync=no_sync)
        assert optimizer.param_groups[0]["weight_decay"] == 5e-2
        return [p.detach().clone() for p in ddp.parameters()]

    for no_sync in (True, False):
        for a, b in zip(run(True, no_sync), run(False, no_sync), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def added_group_worker(rank: int, world: int) -> dict:
    """On ``world`` ranks with different data: the body's group added at step 3 under a named
    method at ratio 1 without masking, beside stock DDP in the same process; and the one line
    with a group it cannot follow (another momentum)."""

    def run(how: str, momentum: float = 0.9) -> list[torch.Tensor]:
        ddp = model()
        optimizer, body = head_then_body(ddp, momentum=momentum)
        if how == "topk":
            gradsift.register_comm_hook(ddp, "topk", ratio=1.0, momentum_masking=False)
        elif how == "auto":
            gradsift.register_comm_hook(ddp)
        for step in range(8):
            if step == 3:
                optimizer.add_param_group(body)
            optimizer.zero_grad()
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
            (ddp(inputs) - inputs[:, :4]).square().mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in ddp.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"stock": run("stock"), "topk": run("topk"), "auto": run("auto", momentum=0.5)}


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_ranks_an_added_group_trains_as_stock_ddp_and_the_fallback_keeps_them_equal():
    from support.distributed import run_workers

    results = run_workers(__file__, "added_group_worker", 2, timeout=120)
    for result in results:
        for a, b in zip(result["topk"], result["stock"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("stock", "topk", "auto"):  # the replicas equal, the one line's after its fallback too
        for a, b in zip(results[0][key], results[1][key], strict=True):
            assert torch.equal(a, b), key
