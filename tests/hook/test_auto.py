"""``compressor="auto"`` (gradsift.hook.auto): the prediction's arithmetic against hand-worked
numbers; the probes route every kept bucket and touch neither the model nor the optimizer; on a 1-rank gloo group, a fast link keeps stock DDP (bit for bit), a link made slow
picks the family's compressed method, which then trains exactly as the method registered by
hand with the measured steps as its warm-up, and a checkpoint resumes the choice bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook import auto, choice

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


def auto_beside_stock(steps: int):
    """The one line and stock DDP, each with SGD momentum, trained ``steps`` on the same data."""
    runs = []
    for hooked in (True, False):
        ddp = model()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
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


def test_a_fast_link_keeps_stock_ddp(one_process_group, monkeypatch):
    """Every probe 1 us (a fast link without its machine-dependent noise), the step timed for real."""
    monkeypatch.setattr(auto.probes, "route_costs", lambda candidates, *args: [1e-6] * len(candidates))
    ddp, _, state, stock = auto_beside_stock(auto.DECIDE_AT + 4)
    stats = state.stats()["auto"]
    assert stats["choice"] == "none" and stats["decided_at"] == auto.DECIDE_AT + 1  # after its optimizer step
    assert set(stats["predicted_ms"]) == {"none", "bf16", "sidco-exp"}  # SGD's candidates
    for a, b in zip(ddp.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)


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


def test_a_slow_link_under_sgd_momentum_runs_sidco_with_momentum_correction(one_process_group, monkeypatch):
    slow_link(monkeypatch, "sidco-exp")
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = gradsift.register_comm_hook(ddp)
    losses = train(ddp, optimizer, auto.DECIDE_AT + 20, torch.Generator().manual_seed(1))
    assert state.stats()["auto"]["choice"] == "sidco-exp"
    assert state.current.compressor.name == "sidco-exp"
    assert state.current.feedback.momentum == 0.9 and optimizer.param_groups[0]["momentum"] == 0.0
    assert state.stats()["step"]["density"] < 0.1  # compressed steps
    assert sum(losses[-5:]) < sum(losses[:5])


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
    what the choice is made of on a real fast link, without its machine-dependent noise)
    against stock DDP: auto keeps it, bit for bit."""
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
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state = gradsift.register_comm_hook(ddp) if hooked else None
        train(ddp, optimizer, auto.DECIDE_AT + 4, torch.Generator().manual_seed(20 + rank))
        runs[hooked] = [p.detach().clone() for p in ddp.parameters()]
        if hooked:
            runs["choice"] = state.stats()["auto"]["choice"]
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


def test_the_real_probes_leave_the_model_and_the_optimizer_as_stock_ddp_has_them(one_process_group):
    """With the real probes on one rank (an allreduce of one rank is a copy; every compressed
    route costs more), auto keeps stock DDP: the parameters equal stock DDP's bit for bit after
    the decision, and SGD's momentum is the optimizer's own (the probe of the momentum-corrected
    candidate took nothing over)."""
    ddp, optimizer, state, stock = auto_beside_stock(auto.DECIDE_AT + 3)
    measured = state.stats()["auto"]["measured_ms"]
    assert state.stats()["auto"]["choice"] == "none"
    assert {"route none", "route bf16", "route sidco-exp"} <= set(measured)
    assert measured["route sidco-exp"] > measured["route none"]
    assert optimizer.param_groups[0]["momentum"] == 0.9
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
    assert auto.probes.timed_calls(1e-3) == auto.probes.PROBES
    assert auto.probes.timed_calls(0.3) == 2  # 0.3 untimed + 2 x 0.3 within 1 s
    assert auto.probes.timed_calls(0.6) == 1  # at least one timed call
    assert auto.probes.timed_calls(1.5) == 0  # the untimed call's time stands


def test_the_kept_share_follows_the_step_time():
    assert auto.probes.kept_elements(1000, 4.0) == 250  # a quarter: about PROBE_SECONDS of a 4 s step
    assert auto.probes.kept_elements(1000, 0.5) == 1000
    assert auto.probes.kept_elements(2**30, 0.1) == auto.probes.PROBE_ELEMENTS


@pytest.mark.parametrize(("step_seconds", "share"), [(4.0, 0.25), (0.01, 1.0)])
def test_a_slow_step_keeps_a_share_of_the_buckets_for_the_probes(
    one_process_group, monkeypatch, step_seconds, share
):
    """Dense steps of 4 s: the probes get about PROBE_SECONDS / 4 s of the model (a quarter;
    its first bucket whatever its size), so the dense probe costs about a second, not a step;
    steps of 10 ms keep every bucket."""
    kept = []

    def route_costs(candidates, buckets, numel, setting):
        kept.append((sum(b.flat.numel() for b in buckets), buckets[0].flat.numel(), numel))
        return [1e-6] * len(candidates)

    monkeypatch.setattr(auto.probes, "route_costs", route_costs)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))), bucket_cap_mb=0.25)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
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
