"""``compressor="auto"`` (gradsift.hook.auto): the prediction's arithmetic against hand-worked
numbers; the probes route every kept bucket (a share of them on a slow link) and touch
neither the model nor the optimizer; on a 1-rank gloo group, under AdamW a fast link keeps
stock DDP (bit for bit) and a link made slow picks the 1-bit method, which then trains
exactly as the method registered by hand with the measured steps as its warm-up; under SGD
the measuring steps are ``sidco-exp`` registered by hand (bit for bit), kept on a slow link
and left for stock DDP on a fast one; a checkpoint resumes the choice bit for bit."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook import auto, choice
from gradsift.hook.taken_over import HOOK_STEP_KEY

pytestmark = pytest.mark.distributed


def test_the_prediction_exchanges_the_dense_allreduce_for_the_candidates_route():
    # dense step 1.0 s of which stock DDP's allreduce 0.8 s: compute 0.2 s
    best, predicted = choice.choose(1.0, {"none": 0.8, "bf16": 0.42, "sidco-exp": 0.06})
    assert predicted == pytest.approx({"none": 1.0, "bf16": 0.62, "sidco-exp": 0.26})
    assert best == "sidco-exp"


def test_a_near_tie_stays_dense():
    # compressed predicted at 0.95 of the dense step: inside the margin, dense is kept
    best, predicted = choice.choose(1.0, {"none": 0.1, "bf16": 0.05})
    assert predicted["bf16"] == pytest.approx(0.95)
    assert best == "none"


def test_a_slow_route_loses_to_the_dense_step():
    best, _ = choice.choose(1.0, {"none": 0.5, "sidco-exp": 0.61})
    assert best == "none"


def test_measured_on_the_compressed_method_the_dense_step_is_predicted_and_preferred():
    # sidco-exp's step 0.3 s of which its route 0.1 s: compute 0.2 s
    best, predicted = choice.choose(0.3, {"none": 2.0, "bf16": 1.0, "sidco-exp": 0.1}, "sidco-exp", "none")
    assert predicted == pytest.approx({"none": 2.2, "bf16": 1.2, "sidco-exp": 0.3})
    assert best == "sidco-exp"
    # a fast link: dense predicted 0.21 s; sidco-exp's 0.3 s and bf16's 0.205 s are not 10 % faster
    best, predicted = choice.choose(0.3, {"none": 0.01, "bf16": 0.005, "sidco-exp": 0.1}, "sidco-exp", "none")
    assert predicted["none"] == pytest.approx(0.21) and best == "none"


def test_what_a_probe_counts_beyond_the_paid_route_comes_off_every_candidate():
    # the measured case of docs/decisions.md: sidco-exp's steps 175 ms, which paid 19 ms of route
    # where its probe counted 93 ms; the probes of none and bf16 counted 70 and 23 ms
    route = {"none": 0.070, "bf16": 0.023, "sidco-exp": 0.093}
    best, predicted = choice.choose(0.175, route, "sidco-exp", "none", paid=0.019)
    # hidden 74 ms: none and bf16 cost 0 ms, sidco-exp 19 ms; compute 156 ms
    assert predicted == pytest.approx({"none": 0.156, "bf16": 0.156, "sidco-exp": 0.175})
    assert best == "none"  # a tie with bf16: the preferred dense step
    # without the paid route the probes alone rank bf16 first (0.105 s against none's 0.152 s)
    best, predicted = choice.choose(0.175, route, "sidco-exp", "none")
    assert predicted["bf16"] == pytest.approx(0.105) and best == "bf16"


def test_a_paid_route_above_the_probe_changes_nothing():
    route = {"none": 2.0, "bf16": 1.0, "sidco-exp": 0.1}
    plain = choice.choose(0.3, route, "sidco-exp", "none")
    assert choice.choose(0.3, route, "sidco-exp", "none", paid=0.15) == plain
    assert choice.running_cost(0.1, 0.15) == 0.1 and choice.running_cost(0.1, 0.04) == 0.04


def test_the_paid_route_is_the_telemetrys_route_phases_per_step_between_marks():
    from gradsift.core.telemetry import BucketRecord, Telemetry
    from gradsift.hook.paid import PaidRoute

    telemetry, paid = Telemetry(), PaidRoute()
    assert paid.since_mark(telemetry) is None  # no mark yet
    paid.mark(telemetry)
    assert paid.since_mark(telemetry) is None  # no step since
    for step, (enc, wait, dec) in enumerate([(3.0, 5.0, 1.0), (2.0, 9.0, 1.0)]):
        records = [BucketRecord(compress_ms=enc, communicate_ms=wait, decompress_ms=dec, bytes_sent=8)]
        telemetry.end_step(step, records, skipped=False)
    assert paid.since_mark(telemetry) == pytest.approx((9.0 + 12.0) / 2 / 1e3)
    telemetry.end_step(2, [BucketRecord(compress_ms=4.0)], skipped=False)
    assert paid.since_mark(telemetry) == pytest.approx(0.004)  # from the new mark
    paid.mark(None)  # a route not timed (stock DDP's lean allreduce)
    assert paid.since_mark(telemetry) is None and paid.since_mark(None) is None


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))


def train(ddp: DDP, optimizer, steps: int, generator: torch.Generator) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ddp(torch.randn(16, 32, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def auto_beside_stock(steps: int, optimizer_of=adamw):
    """The one line and stock DDP, each with ``optimizer_of``, trained ``steps`` on the same data."""
    runs = []
    for hooked in (True, False):
        ddp = model()
        optimizer = optimizer_of(ddp.parameters())
        state = gradsift.register_comm_hook(ddp) if hooked else None
        train(ddp, optimizer, steps, torch.Generator().manual_seed(1))
        runs.append((ddp, optimizer, state))
    (ddp, optimizer, state), (stock, _, _) = runs
    return ddp, optimizer, state, stock


def slow_link(monkeypatch, compressed: str) -> None:
    """A dense step of 1.2 s, 1 s of it stock DDP's allreduce; every candidate's route costs
    1 s except ``compressed``'s, 1 ms."""

    def route_costs(candidates, kept, numel, setting):
        return [1e-3 if name == compressed else 1.0 for name, _ in candidates]

    monkeypatch.setattr(auto.probes, "route_costs", route_costs)
    monkeypatch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 1.2)


def test_under_adamw_a_fast_link_keeps_stock_ddp(one_process_group, monkeypatch):
    """Every probe 1 us (a fast link without its machine-dependent noise), the step timed for real."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    ddp, _, state, stock = auto_beside_stock(auto.DECIDE_AT + 4)
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["decided_at"] == auto.DECIDE_AT + 1  # after its optimizer step
    assert set(stats["predicted_ms"]) == {"none", "bf16"}  # AdamW's in a run of unknown length
    for a, b in zip(ddp.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)


def test_under_sgd_the_measuring_steps_are_sidco_as_registered_by_hand(one_process_group, monkeypatch):
    """The steps before the decision run ``sidco-exp`` at ratio 0.01 with momentum correction,
    bit for bit the method registered by hand (the probes in between change nothing)."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    runs = []
    for method in ({}, {"compressor": "sidco-exp", "ratio": 0.01}):
        ddp = model()
        optimizer = sgd(ddp.parameters())
        state = gradsift.register_comm_hook(ddp, **method)
        train(ddp, optimizer, auto.DECIDE_AT, torch.Generator().manual_seed(1))
        runs.append((ddp, optimizer, state))
    (ddp, optimizer, state), (by_hand, _, _) = runs
    assert state.stats()["auto"]["choice"] == "measuring" and state.current.compressor.name == "sidco-exp"
    assert optimizer.param_groups[0]["momentum"] == 0.0  # taken over, as by hand
    for a, b in zip(ddp.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_measuring_steps_paid_route_is_their_telemetrys_and_enters_the_prediction(
    one_process_group, monkeypatch, tmp_path
):
    """Under SGD the decision reads the route that the measuring steps on ``sidco-exp`` paid:
    the mean over the timed steps (SKIP .. the deciding step) of each step's logged encode +
    wait + decode. Probes of 1 s for ``sidco-exp`` and 0.5 s for ``none``: what the probe of
    ``sidco-exp`` counted beyond that comes off both, so ``none`` costs nothing and is
    predicted at the step less the paid route."""
    routes = {"none": 0.5, "bf16": 2.0, "sidco-exp": 1.0}
    monkeypatch.setattr(
        auto.probes, "route_costs", lambda candidates, *args: [routes[n] for n, _ in candidates]
    )
    monkeypatch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 0.3)
    ddp, log = model(), tmp_path / "steps.jsonl"
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp, log_every=1, jsonl_path=log)
    train(ddp, optimizer, auto.DECIDE_AT + 2, torch.Generator().manual_seed(1))
    stats = state.stats()["auto"]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    timed = [s for s in steps if auto.SKIP <= s["step"] <= stats["decided_at"] - 1]
    assert len(timed) == auto.DECIDE_AT - auto.SKIP + 1
    paid_ms = sum(s["compress_ms"] + s["communicate_ms"] + s["decompress_ms"] for s in timed) / len(timed)
    assert stats["measured_ms"]["route sidco-exp paid"] == pytest.approx(paid_ms)
    assert stats["predicted_ms"]["none"] == pytest.approx(300.0 - paid_ms)
    assert stats["predicted_ms"]["bf16"] == pytest.approx(300.0 - paid_ms + 2000.0 - (1000.0 - paid_ms))


def test_the_start_method_does_not_look_for_the_optimizer_and_scaler_again(one_process_group, monkeypatch):
    """The dense state walks the live objects once, at the first bucket; ``sidco-exp``, started
    at that bucket, takes what it found (a walk costs tens of milliseconds in a torch process)."""
    from gradsift.hook import discovery

    walks = []
    real = discovery.find
    monkeypatch.setattr(discovery, "find", lambda *args: walks.append(args) or real(*args))
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, 3, torch.Generator().manual_seed(1))
    assert state.current.compressor.name == "sidco-exp" and len(walks) == 1


def test_under_sgd_a_fast_link_goes_back_to_stock_ddp_with_its_momentum(one_process_group, monkeypatch):
    """Every probe 1 us: after the measuring steps on ``sidco-exp`` the dense step is predicted
    faster; the run goes on on stock DDP's allreduce (the dense state), SGD with its momentum
    and a buffer per parameter, and ends near stock DDP's loss (what was never sent was
    applied once)."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    ddp, optimizer, state, stock = auto_beside_stock(auto.DECIDE_AT + 30, sgd)
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["decided_at"] == auto.DECIDE_AT + 1
    assert set(stats["predicted_ms"]) == {"none", "bf16", "sidco-exp"}  # SGD's candidates
    assert state.current is state.dense
    assert optimizer.param_groups[0]["momentum"] == 0.9
    assert all("momentum_buffer" in optimizer.state[p] for p in ddp.parameters())
    batch = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hooked, plain = (float(net(batch).square().mean()) for net in (ddp, stock))
    with torch.no_grad():
        start = float(model()(batch).square().mean())
    assert abs(hooked - plain) < 0.01 * start, (hooked, plain, start)  # both trained ~100x down


def test_the_method_left_checks_the_optimizer_no_more(one_process_group, monkeypatch):
    """Back on stock DDP the optimizer has its momentum again; the measuring method's per-step
    checks (gradsift.hook.taken_over) end with its takeover, even while something still holds
    the method's state (as Lightning's callback can)."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, 1, torch.Generator().manual_seed(1))
    measuring = state.current  # held on
    assert measuring.compressor.name == "sidco-exp" and measuring.taken_over is not None
    assert HOOK_STEP_KEY in optimizer.param_groups[0]  # each step under the takeover records the hook's
    train(ddp, optimizer, auto.DECIDE_AT + 5, torch.Generator().manual_seed(2))
    assert state.current is state.dense and optimizer.param_groups[0]["momentum"] == 0.9
    assert HOOK_STEP_KEY not in optimizer.param_groups[0]  # a method entered later starts no warning


def test_a_slow_link_under_adamw_runs_the_one_bit_method_as_registered_by_hand(
    one_process_group, monkeypatch
):
    slow_link(monkeypatch, "efsignsgd")
    warmup = auto.DECIDE_AT + 3
    ddp = model()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    state = gradsift.register_comm_hook(ddp, warmup_steps=warmup, steps=choice.LONG_RUN_STEPS)
    train(ddp, optimizer, warmup + 6, torch.Generator().manual_seed(1))
    assert state.stats()["auto"]["choice"] == "efsignsgd"
    assert state.current.compressor.name == "efsignsgd" and state.current.adam is not None
    by_hand = model()
    hand_optimizer = torch.optim.AdamW(by_hand.parameters(), lr=1e-3, weight_decay=0.1)
    gradsift.register_comm_hook(by_hand, "efsignsgd", optimizer=hand_optimizer, warmup_steps=warmup)
    train(by_hand, hand_optimizer, warmup + 6, torch.Generator().manual_seed(1))
    for a, b in zip(ddp.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_choice_is_logged_with_the_predicted_steps(one_process_group, monkeypatch, caplog):
    """A dense step of 1.2 s, 1 s of it the allreduce; ``bf16``'s route 1 ms: predicted
    1,200 ms for stock DDP, 1.2 - 1 + 0.001 s for ``bf16``. Under the 1-bit Adam method's
    warm-up the line names the step it runs from."""
    slow_link(monkeypatch, "bf16")
    ddp = model()
    optimizer = adamw(ddp.parameters())
    gradsift.register_comm_hook(ddp)
    with caplog.at_level(logging.INFO, logger="gradsift.hook"):
        train(ddp, optimizer, auto.DECIDE_AT + 3, torch.Generator().manual_seed(1))
    assert [r.getMessage() for r in caplog.records if "auto" in r.getMessage()] == [
        f"gradsift auto chose bf16 at step {auto.DECIDE_AT + 1}; predicted ms per step: none 1200.0, bf16 201.0"
    ]
    caplog.clear()
    slow_link(monkeypatch, "efsignsgd")
    ddp = model()
    optimizer = adamw(ddp.parameters())
    gradsift.register_comm_hook(ddp, warmup_steps=20, steps=choice.LONG_RUN_STEPS)
    with caplog.at_level(logging.INFO, logger="gradsift.hook"):
        train(ddp, optimizer, auto.DECIDE_AT + 3, torch.Generator().manual_seed(1))
    assert [r.getMessage() for r in caplog.records if "auto" in r.getMessage()] == [
        f"gradsift auto chose efsignsgd at step {auto.DECIDE_AT + 1}, from step 20 on; predicted ms per "
        "step: none 1200.0, bf16 1200.0, efsignsgd 201.0"
    ]


def test_a_slow_link_under_sgd_momentum_runs_sidco_with_momentum_correction(one_process_group, monkeypatch):
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    losses = train(ddp, optimizer, auto.DECIDE_AT + 20, torch.Generator().manual_seed(1))
    assert state.stats()["auto"]["choice"] == "sidco-exp"
    assert state.current.compressor.name == "sidco-exp"
    assert state.current.feedback.momentum == 0.9 and optimizer.param_groups[0]["momentum"] == 0.0
    assert state.stats()["step"]["density"] < 0.1  # compressed steps
    assert sum(losses[-5:]) < sum(losses[:5])


def test_clipping_after_the_exchange_leaves_momentum_correction_for_stock_ddp(one_process_group, monkeypatch):
    """On a slow link under SGD momentum, a script that clips after backward: where the clip binds
    on the measuring method's step (the velocity it sends, not the gradient), the one line warns
    once and runs stock DDP from the next step, SGD with its momentum back and no prediction to
    watch, and goes on training."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    generator = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="clipping after backward.*auto runs stock DDP") as caught:
        for _ in range(auto.DECIDE_AT + 10):
            optimizer.zero_grad()
            ddp(torch.randn(16, 32, generator=generator)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
            optimizer.step()
    assert len([w for w in caught if "clipping after backward" in str(w.message)]) == 1
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["running"] == "none" and stats["predicted_ms"] == {}
    group = optimizer.param_groups[0]
    assert group["momentum"] == 0.9 and "gradsift_momentum" not in group


@pytest.mark.parametrize("pattern", ["accumulation-without-no-sync", "cycling-scheduler-built-late"])
def test_what_a_named_method_refuses_the_one_line_leaves_for_stock_ddp(
    one_process_group, monkeypatch, pattern
):
    """Patterns stock DDP trains and a takeover cannot follow: several backward passes per optimizer
    step without ``no_sync`` (each would advance the hook's velocity), and a scheduler cycling the
    momentum built after the takeover. A named method refuses them (tests/hook/test_taken_over.py);
    the one line warns once and runs stock DDP from the next step, SGD with its momentum back, and
    goes on training."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    generator = torch.Generator().manual_seed(1)
    scheduler = None
    with pytest.warns(UserWarning, match="auto runs stock DDP's allreduce from here") as caught:
        for step in range(auto.DECIDE_AT + 8):
            if step == 2 and pattern.startswith("cycling"):  # after the takeover at step 0
                scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=40)
            optimizer.zero_grad()
            for _ in range(2 if pattern.startswith("accumulation") else 1):
                ddp(torch.randn(16, 32, generator=generator)).square().mean().backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    assert len([w for w in caught if "auto runs stock DDP" in str(w.message)]) == 1
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["running"] == "none"
    assert "gradsift_momentum" not in optimizer.param_groups[0]
    assert 0.8 < optimizer.param_groups[0]["momentum"] <= 0.95  # SGD's own (cycled by the scheduler)


def test_a_parameter_unfrozen_after_the_one_bit_methods_warm_up_leaves_it_for_stock_ddp(
    one_process_group, monkeypatch
):
    """On a slow link under AdamW in a long run, a first layer frozen after DDP is built and unfrozen
    once the 1-bit Adam method compresses (gradual unfreezing): it has no second moment for the
    frozen preconditioner, which a named method refuses. The one line warns once, takes that step
    with the layer as a tensor the warm-up never moved, records the method as left, and trains on
    with stock DDP and AdamW's own steps: the layer moves, every weight finite."""
    slow_link(monkeypatch, "efsignsgd")
    warmup = auto.DECIDE_AT + 3
    torch.manual_seed(0)
    body = torch.nn.Linear(32, 64)
    ddp = DDP(torch.nn.Sequential(body, torch.nn.Tanh(), torch.nn.Linear(64, 4)), find_unused_parameters=True)
    body.requires_grad_(False)
    optimizer = adamw(ddp.parameters())
    state = gradsift.register_comm_hook(ddp, warmup_steps=warmup, steps=choice.LONG_RUN_STEPS)
    generator = torch.Generator().manual_seed(1)
    unfrozen_at = warmup + 3
    with pytest.warns(UserWarning, match="without a second moment.*auto runs stock DDP") as caught:
        for step in range(unfrozen_at + 5):
            if step == unfrozen_at:
                body.requires_grad_(True)
                before = body.weight.detach().clone()
            optimizer.zero_grad()
            ddp(torch.randn(16, 32, generator=generator)).square().mean().backward()
            optimizer.step()
    assert len([w for w in caught if "second moment" in str(w.message)]) == 1
    stats = state.stats()["auto"]
    assert stats["running"] == "none" and "efsignsgd" in stats["left"]
    assert "second moment" in stats["left"]["efsignsgd"]
    assert "exp_avg_sq" in optimizer.state[body.weight]  # AdamW steps it again
    assert not torch.equal(body.weight, before)
    assert all(torch.isfinite(p).all() for p in ddp.parameters())


def test_sgd_sharing_a_group_with_other_parameters_is_not_momentum_corrected(one_process_group, monkeypatch):
    """On a slow link, but the SGD's one group also holds a parameter outside the model: taking
    the group's momentum would take it from that parameter too, so the candidates are those of
    an optimizer without momentum correction, measured on stock DDP, the group left as built."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    other = torch.nn.Parameter(torch.ones(3))
    optimizer = sgd([*ddp.parameters(), other])
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, auto.DECIDE_AT + 3, torch.Generator().manual_seed(1))
    stats = state.stats()["auto"]
    assert stats["measured_on"] == "none" and set(stats["predicted_ms"]) == {"none", "bf16"}
    assert optimizer.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
        lambda p: torch.optim.SGD(
            [{"params": p[:2]}, {"params": p[2:], "momentum": 0.5}], lr=0.05, momentum=0.9
        ),
        lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=1e-3, maximize=True),
    ],
    ids=["sgd-nesterov", "sgd-dampening", "sgd-two-momenta", "adamw-amsgrad", "adam-maximize"],
)
def test_an_optimizer_the_hook_cannot_take_over_trains_without_a_takeover(
    one_process_group, monkeypatch, make_optimizer
):
    """Settings a named method refuses to take over (Nesterov, dampening, groups with different
    momenta, ``amsgrad``, ``maximize``) are common in scripts; the one line does not refuse them but
    runs the candidates of an optimizer without one -- ``none`` and ``bf16``, measured on stock
    DDP, the optimizer left as built -- also on a slow link."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = make_optimizer(list(ddp.parameters()))
    built = [dict(group, params=None) for group in optimizer.param_groups]
    state = gradsift.register_comm_hook(ddp, steps=5000)  # a long run: AdamW's 1-bit method a candidate too
    train(ddp, optimizer, auto.DECIDE_AT + 3, torch.Generator().manual_seed(1))
    stats = state.stats()["auto"]
    assert stats["measured_on"] == "none" and set(stats["predicted_ms"]) == {"none", "bf16"}
    assert [dict(group, params=None) for group in optimizer.param_groups] == built


@pytest.mark.parametrize("make_optimizer", [sgd, adamw], ids=["sgd-momentum", "adamw"])
def test_an_optimizer_whose_momentum_a_scheduler_cycles_keeps_its_momentum(
    one_process_group, monkeypatch, make_optimizer
):
    """``OneCycleLR`` cycles the momentum (its default ``cycle_momentum=True``), which no takeover
    can follow: on a slow link the one line still runs without one -- candidates ``none`` and
    ``bf16``, measured on stock DDP -- and the scheduler moves the optimizer's momentum as built."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = make_optimizer(ddp.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=40)
    state = gradsift.register_comm_hook(ddp, steps=5000)  # a long run: AdamW's 1-bit method a candidate too
    generator = torch.Generator().manual_seed(1)
    for _ in range(auto.DECIDE_AT + 3):
        train(ddp, optimizer, 1, generator)
        scheduler.step()
    stats = state.stats()["auto"]
    assert stats["measured_on"] == "none" and set(stats["predicted_ms"]) == {"none", "bf16"}
    group = optimizer.param_groups[0]
    assert 0.85 < (group["momentum"] if "momentum" in group else group["betas"][0]) < 0.95  # cycled


def test_a_checkpoint_resumes_the_choice_bit_for_bit(one_process_group, monkeypatch):
    slow_link(monkeypatch, "efsignsgd")
    warmup, more = auto.DECIDE_AT + 1, 4

    def start():
        ddp = model()
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return (
            ddp,
            optimizer,
            gradsift.register_comm_hook(ddp, warmup_steps=warmup, steps=choice.LONG_RUN_STEPS),
        )

    ddp, optimizer, state = start()
    data = torch.Generator().manual_seed(1)
    train(ddp, optimizer, warmup + 2, data)
    saved = copy.deepcopy(
        (ddp.module.state_dict(), optimizer.state_dict(), state.state_dict(), data.get_state())
    )
    train(ddp, optimizer, more, data)

    resumed, resumed_optimizer, resumed_state = start()
    resumed.module.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    resumed_state.load_state_dict(saved[2])
    assert resumed_state.current.compressor.name == "efsignsgd"
    train(resumed, resumed_optimizer, more, torch.Generator().set_state(saved[3]))
    for a, b in zip(ddp.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resumed_choice_is_watched_and_follows_a_rebuilt_optimizer(one_process_group, monkeypatch):
    """Resumed after the decision, the choice is watched as in the run it continues -- its step
    post-hook registered on the optimizer found at the load (it was registered only while
    measuring, so a resumed run never watched its step time again) -- and an optimizer built
    again is followed: ``sidco-exp`` runs on, the new SGD's momentum taken over."""
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, auto.DECIDE_AT + 4, torch.Generator().manual_seed(1))
    saved = copy.deepcopy((ddp.module.state_dict(), optimizer.state_dict(), state.state_dict()))
    train(ddp, optimizer, 3, torch.Generator().manual_seed(2))

    resumed = model()
    resumed.module.load_state_dict(saved[0])
    resumed_optimizer = sgd(resumed.parameters())
    resumed_state = gradsift.register_comm_hook(resumed)
    resumed_state.load_state_dict(saved[2])
    resumed_optimizer.load_state_dict(saved[1])
    train(resumed, resumed_optimizer, 3, torch.Generator().manual_seed(2))
    assert state.stats()["auto"]["drift"] is not None
    assert resumed_state.stats()["auto"]["drift"] is not None  # watched, as the run not stopped
    rebuilt = torch.optim.SGD(resumed.parameters(), lr=0.02, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(resumed, rebuilt, 3, torch.Generator().manual_seed(3))
    assert not [w for w in caught if "gradsift" in str(w.message)]
    assert (
        resumed_state.stats()["auto"]["running"] == "sidco-exp" and rebuilt.param_groups[0]["momentum"] == 0.0
    )


def test_a_checkpoint_taken_while_measuring_on_sidco_resumes_bit_for_bit(one_process_group, monkeypatch):
    """Under SGD with a density warm-up: saved at step 3 (measuring on ``sidco-exp``, inside the
    warm-up), resumed and run past the decision, the same parameters as the run not stopped."""
    slow_link(monkeypatch, "sidco-exp")

    def start():
        ddp = model()
        optimizer = sgd(ddp.parameters())
        return ddp, optimizer, gradsift.register_comm_hook(ddp, density_warmup_steps=4)

    ddp, optimizer, state = start()
    data = torch.Generator().manual_seed(1)
    train(ddp, optimizer, 3, data)
    saved = copy.deepcopy(
        (ddp.module.state_dict(), optimizer.state_dict(), state.state_dict(), data.get_state())
    )
    assert saved[2]["auto"]["choice"] == "measuring" and saved[2]["auto"]["running"] == "sidco-exp"
    more = auto.DECIDE_AT + 6
    train(ddp, optimizer, more, data)
    assert state.stats()["auto"]["decided_at"] == 4 + auto.DECIDE_AT  # timed from the warm-up's end

    resumed, resumed_optimizer, resumed_state = start()
    resumed.module.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    resumed_state.load_state_dict(saved[2])
    train(resumed, resumed_optimizer, more, torch.Generator().set_state(saved[3]))
    assert resumed_state.stats()["auto"]["choice"] == "sidco-exp"
    for a, b in zip(ddp.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_named_methods_checkpoint_is_refused_by_auto_naming_why(one_process_group):
    named = model()
    saved = gradsift.register_comm_hook(named, "topk", ratio=0.1, optimizer=False).state_dict()
    with pytest.raises(InvalidOptionError, match="named compressor, not with compressor='auto'"):
        gradsift.register_comm_hook(model()).load_state_dict(saved)


def test_compressor_options_with_auto_are_refused(one_process_group):
    with pytest.raises(InvalidOptionError, match="ratio.*compressor=<name>"):
        gradsift.register_comm_hook(model(), ratio=0.01)


def two_rank_worker(rank: int, world: int) -> dict:
    """Rank 0 measures a slow link, rank 1 a fast one: the agreed (max) numbers pick the
    compressed method on both. Then a fast link (every probe 1 us, the step timed for real:
    what the choice is made of on a real fast link, without its machine-dependent noise):
    under AdamW against stock DDP, which auto keeps bit for bit; under SGD, where it leaves
    the measuring steps' ``sidco-exp`` for stock DDP with the workers' mean state."""
    patch = pytest.MonkeyPatch()
    slow = rank == 0

    def route_costs(candidates, kept, numel, setting):
        return [(1e-3 if name == "sidco-exp" else 1.0) if slow else 1e-6 for name, _ in candidates]

    patch.setattr(auto.probes, "route_costs", route_costs)
    patch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 1.2 if slow else 1e-3)
    data = torch.Generator().manual_seed(10 + rank)
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, auto.DECIDE_AT + 6, data)
    agreed = {
        "choice": state.stats()["auto"]["choice"],
        "params": [p.detach().clone() for p in ddp.parameters()],
    }
    patch.undo()
    patch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))

    runs = {}
    for hooked in (True, False):
        ddp = model()
        optimizer = adamw(ddp.parameters())
        state = gradsift.register_comm_hook(ddp) if hooked else None
        train(ddp, optimizer, auto.DECIDE_AT + 4, torch.Generator().manual_seed(20 + rank))
        runs[hooked] = [p.detach().clone() for p in ddp.parameters()]
        if hooked:
            runs["choice"] = state.stats()["auto"]["choice"]
    ddp = model()
    state = gradsift.register_comm_hook(ddp)
    train(ddp, sgd(ddp.parameters()), auto.DECIDE_AT + 4, torch.Generator().manual_seed(30 + rank))
    runs["sgd"] = (state.stats()["auto"]["choice"], [p.detach().clone() for p in ddp.parameters()])
    patch.undo()
    return {"agreed": agreed, "localhost": runs}


@pytest.mark.slow
def test_two_ranks_agree_on_the_choice_and_a_fast_link_keeps_stock_ddp():
    from support.distributed import run_workers

    results = run_workers(__file__, "two_rank_worker", 2, timeout=120)
    assert [r["agreed"]["choice"] for r in results] == ["sidco-exp", "sidco-exp"]
    for a, b in zip(results[0]["agreed"]["params"], results[1]["agreed"]["params"], strict=True):
        assert torch.equal(a, b)  # replicas equal after the switch
    for result in results:
        assert result["localhost"]["choice"] == "none"
        for a, b in zip(result["localhost"][True], result["localhost"][False], strict=True):
            assert torch.equal(a, b)  # bit for bit stock DDP
    (choice0, sgd0), (choice1, sgd1) = (result["localhost"]["sgd"] for result in results)
    assert choice0 == choice1 == "none"
    for a, b in zip(sgd0, sgd1, strict=True):
        assert torch.equal(a, b)  # replicas equal after leaving sidco-exp


def test_under_adam_the_one_bit_method_is_a_candidate_only_in_a_long_run(one_process_group, monkeypatch):
    """A short or unknown run keeps Adam's quality with none or bf16 (the 1-bit method ended
    +7.5 % at 314 steps over 100 Mbit/s, results/auto/)."""
    slow_link(monkeypatch, "efsignsgd")
    for steps, expected in ((None, {"none", "bf16"}), (300, {"none", "bf16"}),
                            (choice.LONG_RUN_STEPS, {"none", "bf16", "efsignsgd"})):  # fmt: skip
        ddp = model()
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        state = gradsift.register_comm_hook(ddp, **({} if steps is None else {"steps": steps}))
        train(ddp, optimizer, auto.DECIDE_AT + 2, torch.Generator().manual_seed(1))
        assert set(state.stats()["auto"]["predicted_ms"]) == expected, steps
    with pytest.raises(InvalidOptionError, match="steps"):
        gradsift.register_comm_hook(model(), steps=0)


def probe_worker(rank: int, world: int) -> list[float]:
    """The real probes on two ranks whose buckets differ (SIDCo's payload size follows the
    data above its exact top-k's crossover): a Gaussian bucket on rank 0, a heavy-tailed one
    on rank 1, of 2^21 elements, the gradient of a 2048 x 1024 weight."""
    generator = torch.Generator().manual_seed(rank)
    sample = torch.randn(2**21, generator=generator)
    if rank == 1:
        sample = sample / torch.rand(2**21, generator=generator).clamp_min(1e-3)
    layer = torch.nn.Linear(1024, 2048, bias=False)
    kept = [auto.probes.KeptBucket(sample, [layer.weight])]
    setting = auto.probes.Setting(layer, None, {}, momentum=0.9)
    return auto.probes.route_costs(choice.CANDIDATES["sgd"], kept, 2**21, setting)


@pytest.mark.slow
def test_the_real_probes_run_every_route_when_the_ranks_data_differ():
    """Payload sizes that differ between ranks made a probe's allgather sizes differ and gloo
    abort a rank (SIGABRT), on 4 VGG workers; every route must run and time on every rank."""
    from support.distributed import run_workers

    results = run_workers(__file__, "probe_worker", 2, timeout=120)
    for costs in results:
        assert len(costs) == len(choice.CANDIDATES["sgd"])
        assert all(seconds > 0 for seconds in costs)


def test_the_probe_routes_every_kept_bucket_of_the_deciding_step(one_process_group, monkeypatch):
    """Each bucket's route costs 20 ms more (a sleep): a candidate's probe, scaled to the
    model, must count it once per bucket -- a probe of the first bucket alone, scaled by size,
    counts it once (the wrong pick at 1 Gbit/s, docs/auto.md)."""
    import time

    from gradsift.hook import probes

    routed = probes.route_bucket

    def slow_route(state, bucket):
        time.sleep(0.02)
        return routed(state, bucket)

    monkeypatch.setattr(probes, "route_bucket", slow_route)
    layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(3)))
    kept = [probes.KeptBucket(torch.randn(64 * 64), [layer.weight]) for layer in layers]
    setting = probes.Setting(layers, None, {})
    none, bf16 = probes.route_costs((("none", {}), ("bf16", {})), kept, 3 * 64 * 64, setting)
    assert bf16 >= 3 * 0.02 > none  # three routed buckets; stock DDP's allreduce routes none


def same(a, b) -> bool:
    """Whether two nested containers of tensors and values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_real_probes_leave_the_model_and_the_optimizer_as_they_found_them(one_process_group, monkeypatch):
    """With the real probes on one rank: under SGD the parameters, the optimizer's settings and
    state and the running method's error feedback are the same before and after the probes
    (the probe of the momentum-corrected candidate took nothing over); under AdamW, with the
    dense step chosen, auto trains bit for bit as stock DDP after its probes ran. The probes'
    times are real but the choice is pinned to the dense step (each compressed candidate's
    cost raised by a second): on one rank every route costs well under a millisecond, so
    which one a loaded machine measures faster is noise, not behaviour."""
    seen = []
    real = auto.probes.route_costs

    def dense_wins(candidates, costs):
        return [
            cost if name == "none" else cost + 1.0 for (name, _), cost in zip(candidates, costs, strict=True)
        ]

    def watched(candidates, kept, numel, setting):
        snapshot = lambda: copy.deepcopy(  # noqa: E731
            (list(setting.module.parameters()), optimizer.state_dict(), state.current.feedback.state_dict())
        )
        before = snapshot()
        costs = real(candidates, kept, numel, setting)
        seen.append((before, snapshot()))
        assert all(0 < cost < float("inf") for cost in costs)
        return dense_wins(candidates, costs)

    monkeypatch.setattr(auto.probes, "route_costs", watched)
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    train(ddp, optimizer, auto.DECIDE_AT + 3, torch.Generator().manual_seed(1))
    ((before, after),) = seen
    for a, b in zip(before[0], after[0], strict=True):
        assert torch.equal(a, b)
    assert same(before[1], after[1]) and same(before[2], after[2])
    measured = state.stats()["auto"]["measured_ms"]
    assert state.stats()["auto"]["choice"] == "none"
    assert {"route none", "route bf16", "route sidco-exp"} <= set(measured)

    ran = []
    monkeypatch.setattr(
        auto.probes,
        "route_costs",
        lambda candidates, *args: ran.append(candidates) or dense_wins(candidates, real(candidates, *args)),
    )
    ddp, optimizer, state, stock = auto_beside_stock(auto.DECIDE_AT + 3)
    assert len(ran) == 1
    assert state.stats()["auto"]["choice"] == "none"
    for a, b in zip(ddp.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)


def test_without_an_optimizer_the_choice_is_made_at_the_next_steps_first_bucket(
    one_process_group, monkeypatch
):
    """No optimizer to hook after (``optimizer=False``): the deciding step's buckets are all
    kept, and the next step's first bucket decides, before its exchanges."""
    slow_link(monkeypatch, "bf16")
    ddp = model()
    state = gradsift.register_comm_hook(ddp, optimizer=False)
    for _ in range(auto.DECIDE_AT + 1):
        ddp(torch.randn(16, 32)).square().mean().backward()
    assert state.stats()["auto"]["choice"] == "measuring"
    ddp(torch.randn(16, 32)).square().mean().backward()
    auto_stats = state.stats()["auto"]
    assert auto_stats["choice"] == "bf16" and auto_stats["decided_at"] == auto.DECIDE_AT + 1
    assert state.current.compressor.name == "bf16"  # switched at once: this step ran bf16


@pytest.mark.parametrize(("step_seconds", "decided_at"), [(0.6, 3), (0.3, 4), (0.01, auto.DECIDE_AT + 1)])
def test_slow_dense_steps_end_the_measuring_sooner(one_process_group, monkeypatch, step_seconds, decided_at):
    """Dense steps of 0.6 s: step 1 alone is timed at 0.6 s >= MEASURE_SECONDS (0.5), so step 2
    is the deciding one, decided after its optimizer step (3 dense steps); of 0.3 s: steps 1-2
    add up to 0.6 s, step 3 decides; steps of 10 ms measure up to DECIDE_AT."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = gradsift.register_comm_hook(ddp)
    state.clock = lambda: step_seconds * state.step  # a step's start at its number's time
    train(ddp, optimizer, auto.DECIDE_AT + 2, torch.Generator().manual_seed(1))
    stats = state.stats()["auto"]
    assert stats["decided_at"] == decided_at
    assert stats["measured_ms"]["step"] == pytest.approx(1e3 * step_seconds)


def test_a_slow_probe_is_timed_as_often_as_fits_in_its_budget():
    assert auto.probes.timed_calls(1e-3, 1.0) == auto.probes.PROBES
    assert auto.probes.timed_calls(0.3, 1.0) == 2  # 0.3 untimed + 2 x 0.3 within 1 s
    assert auto.probes.timed_calls(0.6, 1.0) == 1  # at least one timed call
    assert auto.probes.timed_calls(1.5, 1.0) == 0  # the untimed call's time stands


def test_a_probe_that_would_exceed_its_budget_runs_on_the_smallest_buckets():
    # buckets of 100, 800 and 100 elements; 0.01 s on the smallest scales to 0.1 s for all
    assert auto.probes.probe_subset([100, 800, 100], 0.01, 0.2) == [0, 1, 2]  # within the budget
    # 0.05 s scales to 0.5 s: a budget of 0.1 s allows a fifth (200 elements): the two small ones
    assert auto.probes.probe_subset([100, 800, 100], 0.05, 0.1) == [0, 2]
    # 1 s scales to 10 s: 1 % allowed, but the smallest bucket always runs
    assert auto.probes.probe_subset([100, 800, 100], 1.0, 0.1) == [0]


def test_on_a_slow_link_the_dense_probe_routes_a_share_of_the_buckets(one_process_group, monkeypatch):
    """An allreduce made slow (1 ms per thousand elements): three buckets of 4,096, 65,536 and
    4,096 elements would take 74 ms for stock DDP's probe, over its 0.05 s share of the
    budget; it routes the two small ones and scales by elements; the compressed route of
    every bucket is cheap and runs whole."""
    import time

    from gradsift.hook import probes

    monkeypatch.setattr(probes, "PROBE_SECONDS", 0.1)
    routed, allreduce = [], probes.dist.all_reduce

    def slow_allreduce(tensor, *args, **kwargs):
        routed.append(tensor.numel())  # a bucket's (the compressed route's step close: a few elements)
        time.sleep(tensor.numel() / 1e6)
        return allreduce(tensor, *args, **kwargs)

    monkeypatch.setattr(probes.dist, "all_reduce", slow_allreduce)
    layers = [torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(256, 256, bias=False)]
    layers.append(torch.nn.Linear(64, 64, bias=False))
    kept = [probes.KeptBucket(torch.randn(layer.weight.numel()), [layer.weight]) for layer in layers]
    setting = probes.Setting(torch.nn.Sequential(*layers), None, {}, momentum=0.9)
    none, sidco = probes.route_costs((("none", {}), ("sidco-exp", {"ratio": 0.01})), kept, 73728, setting)
    assert max(routed) == 4096  # never the large bucket
    assert none == pytest.approx(73728 / 1e6, rel=0.5)  # two small buckets' time x 9
    assert sidco < none


def test_the_kept_share_follows_the_step_time():
    assert auto.probes.kept_elements(1000, 1.2) == 250  # a quarter: about PROBE_SECONDS of a 1.2 s step
    assert auto.probes.kept_elements(1000, 0.3) == 1000
    assert auto.probes.kept_elements(2**30, 0.1) == auto.probes.PROBE_ELEMENTS


@pytest.mark.parametrize(("step_seconds", "share"), [(1.2, 0.25), (0.01, 1.0)])
def test_a_slow_step_keeps_a_share_of_the_buckets_for_the_probes(
    one_process_group, monkeypatch, step_seconds, share
):
    """Dense steps of 1.2 s: the probes get about PROBE_SECONDS / 1.2 s of the model (a quarter;
    its first bucket whatever its size), so the dense probe costs about a second, not a step;
    steps of 10 ms keep every bucket."""
    kept = []

    def route_costs(candidates, buckets, numel, setting):
        kept.append((sum(b.flat.numel() for b in buckets), buckets[0].flat.numel(), numel))
        return [1e-6] * len(candidates)

    monkeypatch.setattr(auto.probes, "route_costs", route_costs)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))), bucket_cap_mb=0.25)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)  # measured on dense steps
    state = gradsift.register_comm_hook(ddp)
    state.clock = lambda: step_seconds * state.step
    for _ in range(auto.DECIDE_AT + 2):
        optimizer.zero_grad()
        ddp(torch.randn(8, 256)).square().mean().backward()
        optimizer.step()
    ((elements, first, numel),) = kept
    if share < 1:
        assert first < numel and elements <= max(first, int(share * numel)) < numel
    else:
        assert elements == numel
