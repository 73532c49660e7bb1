"""``compressor="auto"`` measures again when the step time drifts (gradsift.hook.drift): the
window rule and its hysteresis against hand-worked windows; on a 1-rank gloo group, a run
whose step time drifts from stock DDP's switches to the method that the new probes favour,
and then trains exactly as that method registered by hand with the steps before as its dense
warm-up; leaving error feedback gives SGD its momentum back (a dense exchange given back is
stock DDP); the 1-bit Adam method runs on and says why; a method left for what the script does
is never picked again."""

from __future__ import annotations

import itertools
import json
import logging
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.hook import auto, choice, drift
from support.oracles import frozen_variance_start

pytestmark = pytest.mark.distributed


def windows(watch: drift.DriftWatch, step_seconds: list[float]) -> list[bool]:
    """Feed ``watch`` one window per entry (every step of it ``step_seconds[i]`` long); per
    window whether a re-measure came due."""
    now, due = 0.0, []
    watch.tick(now)
    for seconds in step_seconds:
        median = None
        for _ in range(drift.WINDOW):
            now += seconds
            median = watch.tick(now)
        assert median == pytest.approx(seconds)  # the window ends with its last step
        due.append(watch.due(median))
    return due


def test_two_drifting_windows_in_a_row_make_a_re_measure_due():
    # expected 1.0 s: 1.1 is inside the 20 % band, 1.3 and 0.7 outside it
    assert windows(drift.DriftWatch(1.0), [1.1, 1.3, 1.3]) == [False, False, True]
    assert windows(drift.DriftWatch(1.0), [1.0, 0.7, 0.7]) == [False, False, True]  # faster later: due


def test_a_first_window_faster_than_predicted_becomes_the_expectation():
    """The choice beat its prediction (0.7 s against 1.0 s): no strike, 0.7 s is expected from
    then on, and drifts are counted from it (0.95 s is +36 % of 0.7 s); a first window slower
    than predicted counts as drifting."""
    watch = drift.DriftWatch(1.0)
    assert windows(watch, [0.7, 0.7, 0.72, 0.95, 0.95]) == [False, False, False, False, True]
    assert watch.expected == pytest.approx(0.7)
    assert windows(drift.DriftWatch(1.0), [1.3, 1.3]) == [False, True]


def test_a_window_back_in_the_band_starts_the_count_over():
    assert windows(drift.DriftWatch(1.0), [1.3, 1.0, 1.3, 1.0, 1.3, 1.3]) == [False] * 5 + [True]
    watch = drift.DriftWatch(1.0)
    assert windows(watch, [1.3, 1.3, 1.3]) == [False, True, False]  # due resets the count
    assert watch.stats() == {"expected_ms": 1000.0, "window_ms": pytest.approx(1300.0), "strikes": 1}


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))


def train(ddp: DDP, optimizer, steps: int, generator: torch.Generator) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        ddp(torch.randn(16, 32, generator=generator)).square().mean().backward()
        optimizer.step()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def drifting_run(
    monkeypatch,
    first_fast: str,
    then_fast: str,
    optimizer_of=sgd,
    step_s=2.0,
    seed=1,
    paid=False,
    **hook_options,
):
    """A run whose first decision sees ``first_fast``'s route at 1 ms and every other 1 s (a
    dense step of 1.2 s), whose steps then take ``step_s`` each on the host clock (2 s: +67 %,
    drifted), and whose re-measure sees ``then_fast``'s route at 1 ms; data from ``seed``. Its
    measuring steps run stock DDP under every optimizer, so the first choice is what switches."""
    fast = {"name": first_fast}
    monkeypatch.setitem(choice.START, "sgd", "none")  # measured on stock DDP (SGD starts compressed)
    monkeypatch.setattr(
        auto.probes,
        "route_costs",
        lambda candidates, *args: [1e-3 if name == fast["name"] else 1.0 for name, _ in candidates],
    )
    monkeypatch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 1.2)
    if not paid:  # the steps pay the route the probes say (the fiction's link, not this machine's few ms)
        monkeypatch.setattr(auto.PaidRoute, "since_mark", lambda self, telemetry: None)
    ddp = model()
    optimizer = optimizer_of(ddp.parameters())
    state = gradsift.register_comm_hook(ddp, **hook_options)
    data = torch.Generator().manual_seed(seed)
    train(ddp, optimizer, auto.DECIDE_AT + 2, data)
    assert state.stats()["auto"]["choice"] == first_fast
    clock = itertools.count(step=step_s)
    state.clock = lambda: float(next(clock))
    fast["name"] = then_fast
    train(ddp, optimizer, STEPS - auto.DECIDE_AT - 2, data)
    return ddp, optimizer, state


STEPS = auto.DECIDE_AT + 2 + 2 * drift.WINDOW + 6


def stock_run(optimizer_of=sgd) -> DDP:
    stock = model()
    train(stock, optimizer_of(stock.parameters()), STEPS, torch.Generator().manual_seed(1))
    return stock


def test_a_drifted_step_time_re_measures_and_switches_as_registered_by_hand(
    one_process_group, monkeypatch, caplog
):
    """Stock DDP first (its probe fastest); the step time drifts; the re-measure finds bf16's
    route fastest and switches: the run then equals bf16 registered by hand with the steps
    before the switch as its dense warm-up (bit for bit; bf16's rounding makes it differ from
    stock DDP's). The log says both choices."""
    with caplog.at_level(logging.INFO, logger="gradsift.hook"):
        ddp, _, state = drifting_run(monkeypatch, "none", "bf16")
    stats = state.stats()["auto"]
    assert stats["choice"] == "bf16" and stats["running"] == "bf16" and stats["remeasures"] == 1
    first, again = (r.getMessage() for r in caplog.records if r.getMessage().startswith("gradsift auto"))
    assert first.startswith(
        f"gradsift auto chose none at step {auto.DECIDE_AT + 1}; predicted ms per step: none "
    )
    assert again.startswith(f"gradsift auto measured again and chose bf16 at step {stats['decided_at']}; ")
    switched = state.switched_at
    assert auto.DECIDE_AT + 2 * drift.WINDOW < switched < STEPS
    assert stats["predicted_ms"]["none"] == pytest.approx(2000.0)  # the drifted window's median
    by_hand = model()
    hand_optimizer = sgd(by_hand.parameters())
    gradsift.register_comm_hook(by_hand, "bf16", optimizer=hand_optimizer, warmup_steps=switched)
    train(by_hand, hand_optimizer, STEPS, torch.Generator().manual_seed(1))
    for a, b in zip(ddp.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(a, b)
    stock = stock_run()
    assert any(not torch.equal(a, b) for a, b in zip(ddp.parameters(), stock.parameters(), strict=True))


def test_a_re_measure_reads_the_route_paid_in_the_last_window(one_process_group, monkeypatch, tmp_path):
    """The route a re-measure takes off the probes is what the running method's steps paid in
    the drift window that made it due: the mean of each step's logged encode + wait + decode
    over that window's 50 steps (it ends the step before the kept one, decided after it)."""
    log = tmp_path / "steps.jsonl"
    _, _, state = drifting_run(monkeypatch, "bf16", "bf16", paid=True, log_every=1, jsonl_path=log)
    stats = state.stats()["auto"]
    assert stats["remeasures"] == 1 and stats["running"] == "bf16"
    steps = {entry["step"]: entry for entry in map(json.loads, log.read_text().splitlines())}
    window = [steps[k] for k in range(stats["decided_at"] - 1 - drift.WINDOW, stats["decided_at"] - 1)]
    paid_ms = sum(e["compress_ms"] + e["communicate_ms"] + e["decompress_ms"] for e in window) / drift.WINDOW
    assert stats["measured_ms"]["route bf16 paid"] == pytest.approx(paid_ms)


def test_leaving_error_feedback_gives_the_optimizer_its_momentum_back(one_process_group, monkeypatch):
    """A dense exchange with momentum correction (top-k at ratio 1, no momentum masking) is
    stock DDP + SGD momentum and weight decay rearranged; when the drift re-measure leaves it
    for stock DDP, the optimizer gets its momentum, weight decay and a buffer equal to the
    workers' velocity back, and the run goes on as stock DDP throughout (to rounding)."""
    monkeypatch.setitem(
        choice.CANDIDATES, "sgd", (("none", {}), ("topk", {"ratio": 1.0, "momentum_masking": False}))
    )
    ddp, optimizer, state = drifting_run(monkeypatch, "topk", "none")
    stats = state.stats()["auto"]
    assert stats["running"] == "none" and stats["remeasures"] == 1 and state.switched_at > auto.DECIDE_AT + 2
    group = optimizer.param_groups[0]
    assert group["momentum"] == 0.9 and group["weight_decay"] == 1e-3
    assert "gradsift_momentum" not in group and "gradsift_weight_decay" not in group
    stock = stock_run()
    for a, b in zip(ddp.parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_leaving_sidco_flushes_what_was_never_sent(one_process_group, monkeypatch):
    """sidco-exp at 1 %: the residual holds most of each step's velocity; after leaving it the
    parameters moved by the flush (lr times the workers' mean residual), and training goes on
    with the optimizer's own momentum."""
    ddp, optimizer, state = drifting_run(monkeypatch, "sidco-exp", "none")
    assert state.stats()["auto"]["running"] == "none"
    assert optimizer.param_groups[0]["momentum"] == 0.9
    assert all("momentum_buffer" in optimizer.state[p] for p in ddp.parameters())
    assert all(torch.isfinite(p).all() for p in ddp.parameters())


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}


def adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def adam_method_then_stock(entered: int, left: int) -> DDP:
    """The oracle: stock DDP + AdamW before step ``entered``; from it the frozen-variance method
    written out (tests/hook/test_adam.py: ``u <- beta1 u + g`` from the bias-corrected first
    moment, ``x <- x (1 - lr wd) - lr (1 - beta1) u / D`` with ``D`` frozen); from ``left``
    stock AdamW again, with Adam's state at ``t = t_0 + (left - entered)``: ``m = (1 - beta1)
    (1 - beta1^t) u`` and ``v = v_0 (1 - beta2^t) / (1 - beta2^t_0)``."""
    ddp = model()
    optimizer = adamw(ddp.parameters())
    data = torch.Generator().manual_seed(1)
    (beta1, beta2), lr, decay = ADAMW["betas"], ADAMW["lr"], ADAMW["weight_decay"]
    params = list(ddp.parameters())
    velocity: dict = {}
    frozen: dict = {}
    for step in range(STEPS):
        optimizer.zero_grad()
        ddp(torch.randn(16, 32, generator=data)).square().mean().backward()
        if not entered <= step < left:
            optimizer.step()
            continue
        with torch.no_grad():
            if not velocity:
                velocity, frozen = frozen_variance_start(optimizer, params, ADAMW["betas"])
            for p in params:
                velocity[p] = beta1 * velocity[p] + p.grad
                p.mul_(1 - lr * decay).sub_(lr * (1 - beta1) * velocity[p] / frozen[p])
            if step == left - 1:  # hand AdamW its state back
                for p in params:
                    state = optimizer.state[p]
                    t0 = float(state["step"])
                    t = t0 + (left - entered)
                    state["exp_avg"] = (1 - beta1) * (1 - beta1**t) * velocity[p]
                    state["exp_avg_sq"] = state["exp_avg_sq"] * (1 - beta2**t) / (1 - beta2**t0)
                    state["step"] = torch.tensor(t)
    return ddp


def test_leaving_the_one_bit_adam_method_gives_adamw_its_moments_back(one_process_group, monkeypatch):
    """The 1-bit Adam method with a dense exchange (top-k at ratio 1, no momentum masking) is
    the frozen-variance method written out; when the drift re-measure leaves it for stock DDP,
    AdamW steps on from the moments the method kept (the oracle above), to rounding."""
    monkeypatch.setattr(choice, "ONE_BIT_ADAM", ("topk", {"ratio": 1.0, "momentum_masking": False}))
    ddp, optimizer, state = drifting_run(
        monkeypatch, "topk", "none", adamw, steps=choice.LONG_RUN_STEPS, warmup_steps=auto.DECIDE_AT + 1
    )
    stats = state.stats()["auto"]
    assert stats["running"] == "none" and stats["remeasures"] == 1
    assert not optimizer._optimizer_step_pre_hooks  # the method's takeover is gone
    oracle = adam_method_then_stock(auto.DECIDE_AT + 1, state.switched_at)
    for a, b in zip(ddp.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_steady_step_time_is_never_re_measured(one_process_group, monkeypatch):
    """Steps exactly as predicted (1.2 s of the dense step): no window drifts."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1.0] * len(candidates))
    monkeypatch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 1.2)
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = gradsift.register_comm_hook(ddp)
    data = torch.Generator().manual_seed(1)
    train(ddp, optimizer, auto.DECIDE_AT + 2, data)
    clock = itertools.count(step=1.2)
    state.clock = lambda: float(next(clock))
    train(ddp, optimizer, 3 * drift.WINDOW, data)
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["remeasures"] == 0
    assert stats["drift"]["window_ms"] == pytest.approx(1200.0) and stats["drift"]["strikes"] == 0


def two_rank_drift_worker(rank: int, world: int) -> dict:
    """Rank 0's host clock drifts (+67 %), rank 1's holds steady: the window's agreed (max)
    median makes both re-measure, leave sidco-exp for stock DDP and hand SGD its momentum back
    together, on different data."""
    patch = pytest.MonkeyPatch()
    ddp, optimizer, state = drifting_run(
        patch, "sidco-exp", "none", step_s=2.0 if rank == 0 else 1.2, seed=30 + rank
    )
    patch.undo()
    stats = state.stats()["auto"]
    return {
        "running": stats["running"],
        "switched_at": state.switched_at,
        "params": [p.detach().clone() for p in ddp.parameters()],
        "buffers": [optimizer.state[p]["momentum_buffer"].clone() for p in ddp.parameters()],
    }


@pytest.mark.slow
def test_two_ranks_agree_on_the_drift_and_leave_error_feedback_together():
    from support.distributed import run_workers

    results = run_workers(__file__, "two_rank_drift_worker", 2, timeout=120)
    assert [r["running"] for r in results] == ["none", "none"]
    assert results[0]["switched_at"] == results[1]["switched_at"]
    for key in ("params", "buffers"):  # replicas and momentum buffers equal after the hand-back
        for a, b in zip(results[0][key], results[1][key], strict=True):
            assert torch.equal(a, b)


def test_a_method_left_for_clipping_is_never_picked_again(one_process_group, monkeypatch):
    """The probes favour ``sidco-exp`` throughout and the steps drift after the choice; the
    script clips after backward from step 10, which momentum correction cannot follow: ``auto``
    leaves ``sidco-exp`` for stock DDP, warns once and records why. Its re-measures then choose
    among the others only (it came back at each one, found the clipping again and left, every
    hundred steps), and the record survives a checkpoint."""
    monkeypatch.setitem(choice.START, "sgd", "none")
    monkeypatch.setattr(
        auto.probes,
        "route_costs",
        lambda candidates, *args: [1e-3 if n == "sidco-exp" else 1.0 for n, _ in candidates],
    )
    monkeypatch.setattr(auto.AutoHookState, "_step_seconds", lambda self: 1.2)
    monkeypatch.setattr(auto.PaidRoute, "since_mark", lambda self, telemetry: None)
    ddp = model()
    optimizer = sgd(ddp.parameters())
    state = gradsift.register_comm_hook(ddp)
    data, running = torch.Generator().manual_seed(1), []
    clock = itertools.count(step=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10 + 5 * drift.WINDOW):
            if step == 10:
                state.clock = lambda: float(next(clock))
            optimizer.zero_grad()
            ddp(torch.randn(16, 32, generator=data)).square().mean().backward()
            if step >= 10:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
            optimizer.step()
            running.append(state.stats()["auto"]["running"])
    assert "sidco-exp" in running[:10] and "sidco-exp" not in running[20:]
    stats = state.stats()["auto"]
    assert stats["remeasures"] >= 1 and list(stats["left"]) == ["sidco-exp"]
    assert "clip_grad_norm_" in stats["left"]["sidco-exp"]
    assert len([w for w in caught if "auto runs stock DDP" in str(w.message)]) == 1
    resumed = gradsift.register_comm_hook(model())
    resumed.load_state_dict(state.state_dict())
    assert resumed.stats()["auto"]["left"] == stats["left"]
