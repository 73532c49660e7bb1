"""``adam="zero-one"``: the frozen-variance method with 0/1 Adam's local steps (gradsift.hook.zero_one).

The oracle is 0/1 Adam written out from its definition (Lu et al. 2022, with AdamW's decoupled
decay and the clipping of the loop), both workers simulated in one process, each with its own
copy of the model: AdamW dense for ``WARMUP`` steps on the workers' mean gradient; then per
worker ``u_k <- beta1 u_k + g_k`` (started from the warm-up's bias-corrected first moment in
velocity units), ``a_k <- a_k + lr u_k``; a local step clips ``(1 - beta1) u_k`` and steps
``x_k <- x_k (1 - lr wd) - lr m / D``; an interval's last step averages ``a_k`` exactly
(every coordinate sent: top-k at ratio 1), clips ``(1 - beta1) abar / Gamma`` and sets every
worker to ``xhat prod(1 - lr wd) - Gamma m / D``, ``u_k = abar / Gamma``, ``a_k = 0``.
With the warm-up in 4-bit codes, what it left in the workers' residuals travels with the first
synchronisation, times that step's learning rate. The intervals for ``local_steps=(2, 4)``: 1, 1, 2, 4, 4, ... compressed steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.store import TensorStore
from gradsift.exchanges.two_stage import SERVER_CHUNK
from gradsift.hook.feedback import RESIDUAL
from gradsift.hook.zero_one import ZeroOneAdamStep
from support.distributed import run_workers
from support.models import flat_gradients, flat_params, loss_of, make_model
from support.oracles import error_feedback_mean, four_bit_blocks, frozen_variance_start
from support.steps import (
    assert_every_resume_is_the_whole_run,
    assert_the_survivor_raised,
    refusal_messages,
    train_until_peer_failure,
    train_with_restart,
)

WARMUP, STEPS, LR, WD, BETAS, WORLD, EPS = 3, 18, 0.01, 0.1, (0.9, 0.99), 2, 1e-8
LOCAL_STEPS = (2, 4)
#: Compressed steps (0-based, from the warm-up's end) that end an interval under LOCAL_STEPS:
#: intervals start at s = 0, 1, 2, 4, 8, 12 with lengths min(4, 2^(s // 2)) = 1, 1, 2, 4, 4, 4.
SYNCS = {0, 1, 3, 7, 11}
EXACT = {"ratio": 1.0, "granularity": "layer"}
#: The residual tables a coded warm-up leaves (the workers', the two-stage exchange's server chunks).
LEFT = (RESIDUAL, SERVER_CHUNK)


def lr_at(step: int) -> float:
    """The loop's learning-rate schedule: it changes inside an interval, so ``Gamma`` is a sum."""
    return LR * (1.0 + 0.5 * (step % 3))


def clipped(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``clip_grad_norm_(..., 1.0)`` of the loop, on plain tensors."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    factor = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    return [g * factor for g in grads]


def reference_run(coded: bool = False) -> list[torch.Tensor]:
    """0/1 Adam by hand (module docstring); each worker's final parameters. ``coded``: the
    warm-up in 4-bit block codes with error feedback (tests/hook/test_warmup_code.py's), whose
    last residuals travel with the first synchronisation, times its learning rate."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    params = list(model.parameters())
    residual = [[torch.zeros(p.numel()) for p in params] for _ in range(WORLD)]
    for step in range(WARMUP):
        per_worker = [flat_gradients(model, k, step) for k in range(WORLD)]
        for i, p in enumerate(params):
            g = [per_worker[k][i] for k in range(WORLD)]
            mean = (
                error_feedback_mean(g, [r[i] for r in residual], four_bit_blocks) if coded else sum(g) / WORLD
            )
            p.grad = mean.reshape(p.shape)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.param_groups[0]["lr"] = lr_at(step)
        optimizer.step()
    start, preconditioner = frozen_variance_start(optimizer, params, BETAS)
    workers = [make_model() for _ in range(WORLD)]
    with torch.no_grad():
        for worker in workers:
            for p, q in zip(worker.parameters(), params, strict=True):
                p.copy_(q)
    shapes = [p.shape for p in params]
    velocity = [[start[p].clone() for p in params] for _ in range(WORLD)]
    accumulated = [[torch.zeros(s) for s in shapes] for _ in range(WORLD)]
    anchor = [p.detach().clone() for p in params]
    span = 0.0
    for j in range(STEPS - WARMUP):
        lr = lr_at(WARMUP + j)
        for k, worker in enumerate(workers):
            grads = flat_gradients(worker, k, WARMUP + j)
            for i, g in enumerate(grads):
                velocity[k][i] = BETAS[0] * velocity[k][i] + g.reshape(shapes[i])
                accumulated[k][i] = accumulated[k][i] + lr * velocity[k][i]
        span += lr
        anchor = [a * (1 - lr * WD) for a in anchor]
        with torch.no_grad():
            if j in SYNCS:
                left = [lr * sum(r[i] for r in residual).reshape(shapes[i]) / WORLD if j == 0 else 0.0
                        for i in range(len(shapes))]  # fmt: skip
                mean = [
                    sum(accumulated[k][i] for k in range(WORLD)) / WORLD + left[i] for i in range(len(shapes))
                ]
                moment = clipped([(1 - BETAS[0]) * m / span for m in mean])
                anchor = [
                    a - span * m / preconditioner[p] for a, m, p in zip(anchor, moment, params, strict=True)
                ]
                for k, worker in enumerate(workers):
                    for p, a in zip(worker.parameters(), anchor, strict=True):
                        p.copy_(a)
                    velocity[k] = [m / span for m in mean]
                    accumulated[k] = [torch.zeros(s) for s in shapes]
                span = 0.0
            else:
                for k, worker in enumerate(workers):
                    moment = clipped([(1 - BETAS[0]) * u for u in velocity[k]])
                    for p, m, q in zip(worker.parameters(), moment, params, strict=True):
                        p.mul_(1 - lr * WD).sub_(lr * m / preconditioner[q])
    return [flat_params(worker) for worker in workers]


def zero_one_hooked(name: str, **options) -> tuple[DDP, torch.optim.AdamW, object]:
    """The tests' model in DDP, its AdamW, and the one line with ``adam="zero-one"``."""
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    state = gradsift.register_comm_hook(
        model,
        name,
        optimizer=optimizer,
        warmup_steps=WARMUP,
        adam="zero-one",
        local_steps=LOCAL_STEPS,
        **options,
    )
    return model, optimizer, state


def hooked_run(
    rank: int, name: str, options: dict, resume_at: int | None = None
) -> tuple[torch.Tensor, list]:
    """The user's loop with the one line (a checkpoint and a restart into fresh objects at
    ``resume_at``); after every step, the hook's step stats and this rank's parameters."""
    models: list = []
    optimizers: list = []

    def fresh():
        model, optimizer, state = zero_one_hooked(name, **options)
        optimizers.append(optimizer)
        models.append(model)
        return model, optimizer, state

    def loss_at(model: DDP, step: int) -> torch.Tensor:
        optimizers[-1].param_groups[0]["lr"] = lr_at(step)  # a scheduler's change, before the step
        return loss_of(model, rank, step)

    seen: list = []
    last = train_with_restart(
        fresh,
        STEPS,
        loss_at,
        resume_at,
        lambda _, state: seen.append((state.stats()["step"], flat_params(models[-1]))),
    )
    return flat_params(last), seen


def worker(rank: int, world: int) -> dict:
    exact, _ = hooked_run(rank, "topk", EXACT)
    coded, _ = hooked_run(rank, "topk", {**EXACT, "warmup_compressor": "blockquant"})
    whole, steps = hooked_run(rank, "efsignsgd", {"granularity": "layer"})
    resumed = {
        at: hooked_run(rank, "efsignsgd", {"granularity": "layer"}, at)[0] for at in (WARMUP + 5, WARMUP + 6)
    }
    return {"exact": exact, "coded": coded, "whole": whole, "steps": steps, "resumed": resumed}


@pytest.fixture(scope="module")
def runs():
    return run_workers(__file__, "worker", WORLD, timeout=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_one_equals_the_method_written_out(runs):
    expected, coded = reference_run(), reference_run(coded=True)
    assert not torch.allclose(expected[0], expected[1])  # the local steps show
    assert not torch.allclose(expected[0], coded[0], rtol=1e-5, atol=1e-6)  # and the code
    for rank, result in enumerate(runs):
        torch.testing.assert_close(result["exact"], expected[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["coded"], coded[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_only_an_interval_s_last_step_sends_the_message_and_the_replicas_agree_after_it(runs):
    """A local step exchanges only its 4-byte non-finite flag per bucket; a synchronisation
    the 1-bit message (signs and a scale per layer) and leaves the ranks' parameters equal."""
    numels = [p.numel() for p in make_model().parameters()]
    message = sum(-(-n // 8) + 4 for n in numels)
    for j in range(STEPS - WARMUP):
        sent = [result["steps"][WARMUP + j][0]["bytes_sent"] for result in runs]
        params = [result["steps"][WARMUP + j][1] for result in runs]
        if j in SYNCS:
            assert sent[0] >= message, j
            assert torch.equal(params[0], params[1]), j
        else:
            assert sent == [4, 4], j
            assert not torch.equal(params[0], params[1]), j


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_is_bit_for_bit_inside_an_interval_and_at_its_end(runs):
    assert_every_resume_is_the_whole_run(runs)


def nonfinite_worker(rank: int, world: int) -> list:
    """Rank 1's loss is NaN at a local step; ``nonfinite="skip"``: every rank drops that step."""
    model, optimizer, state = zero_one_hooked("efsignsgd", nonfinite="skip")
    seen = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        if rank == 1 and step == WARMUP + 4:  # inside the interval of compressed steps 4-7
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        record = state.stats()["step"]
        seen.append((state.step, record["skipped"], record["bytes_sent"], flat_params(model)))
    return seen


@pytest.mark.slow
@pytest.mark.distributed
def test_a_nan_at_a_local_step_drops_it_on_every_rank_and_the_schedule_stays_agreed():
    first, second = run_workers(__file__, "nonfinite_worker", WORLD, timeout=120)
    assert [s[:3] for s in first] == [s[:3] for s in second]  # steps, drops and bytes alike
    assert [s[1] for s in first].count(True) == 1 and first[WARMUP + 4][1]
    syncs = [i for i, s in enumerate(first) if i >= WARMUP and s[2] > 4]
    assert len(syncs) == 5  # the dropped step did not count: the intervals moved on by one
    for i in syncs:
        assert torch.equal(first[i][3], second[i][3]), i
    assert torch.isfinite(first[-1][3]).all()


def dying_worker(rank: int, world: int) -> dict:
    model, optimizer, _ = zero_one_hooked("efsignsgd")

    def loss_at(model: DDP, step: int) -> torch.Tensor:
        if rank == 1 and step == WARMUP + 5:  # a local step
            import os

            os._exit(3)
        return loss_of(model, rank, step)

    return train_until_peer_failure(model, optimizer, loss_at, range(STEPS))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dead_peer_at_a_local_step_raises_instead_of_hanging():
    results = run_workers(__file__, "dying_worker", 2, group_timeout=5.0, timeout=120, expect_exit={1: 3})
    assert_the_survivor_raised(results[0])


def refusals_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    def one_line(groups=None, **options):
        model = DDP(make_model())
        optimizer = torch.optim.AdamW(groups(model) if groups else model.parameters(), lr=LR)
        gradsift.register_comm_hook(model, "efsignsgd", optimizer=optimizer, warmup_steps=WARMUP, **options)

    def two_rates(model):
        weights, rest = list(model.parameters())[:1], list(model.parameters())[1:]
        return [{"params": weights, "lr": LR}, {"params": rest, "lr": 2 * LR}]

    def added_at_another_rate():
        model = DDP(make_model())
        first, rest = list(model.parameters())[:1], list(model.parameters())[1:]
        optimizer = torch.optim.AdamW(first, lr=LR)
        gradsift.register_comm_hook(
            model, "efsignsgd", optimizer=optimizer, warmup_steps=WARMUP, adam="zero-one"
        )
        optimizer.add_param_group({"params": rest, "lr": 2 * LR})  # during the warm-up: followed
        for step in range(WARMUP + 2):
            optimizer.zero_grad()
            loss_of(model, 0, step).backward()
            optimizer.step()

    assert dist.get_world_size() == 1
    return refusal_messages(
        {
            "added": added_at_another_rate,
            "other method": lambda: one_line(local_steps=(2, 4)),
            "zero": lambda: one_line(adam="zero-one", local_steps=(0, 4)),
            "shape": lambda: one_line(adam="zero-one", local_steps=4),
            "rates": lambda: one_line(two_rates, adam="zero-one"),
            "default": lambda: one_line(adam="zero-one"),
        }
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_what_zero_one_cannot_run_is_refused_by_name():
    (result,) = run_workers(__file__, "refusals_worker", 1)
    assert "needs adam='zero-one'" in result["other method"]
    for kind in ("zero", "shape"):
        assert "(double_every, longest), two ints >= 1" in result[kind]
    for kind in ("rates", "added"):  # a group added at another rate too (it was left out)
        assert "one learning rate" in result[kind] and str(sorted([LR, 2 * LR])) in result[kind]
    assert result["default"] == "no error"


def test_the_intervals_double_where_they_start_and_stop_at_the_longest():
    """``local_steps=(3, 8)`` after a 5-step warm-up: intervals start at s = 0, 1, 2 (length 1),
    3, 5 (2^1 = 2), 7 (2^2 = 4), 11, 19, 27, ... (2^3 and then capped at 8)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    numbers = {id(p): i for i, p in enumerate(model.parameters())}
    method = ZeroOneAdamStep(optimizer, numbers, warmup_steps=5, local_steps=(3, 8))
    expected = [5 + end for end in (0, 1, 2, 4, 6, 10, 18, 26, 34, 42)]
    assert [step for step in range(48) if method.syncs(step)] == expected
    late_first = ZeroOneAdamStep(optimizer, numbers, warmup_steps=5, local_steps=(3, 8))
    assert (
        late_first.syncs(47) and not late_first.syncs(46) and late_first.syncs(9)
    )  # a resume asks late first
    method.detach()
    late_first.detach()


def two_stage_worker(rank: int, world: int) -> dict:
    params, seen = hooked_run(rank, "efsignsgd", {"warmup_compressor": "blockquant", "exchange": "two-stage"})
    return {"params": params, "seen": seen}


@pytest.mark.slow
@pytest.mark.distributed
def test_through_the_two_stage_exchange_the_replicas_agree_after_every_synchronisation():
    """1-bit Adam's compressed allreduce on 4 ranks (a server residual per chunk): every rank
    holds the same mean, so the same parameters after each interval's last step."""
    results = run_workers(__file__, "two_stage_worker", 4, timeout=120)
    for j in SYNCS:
        step = WARMUP + j
        assert all(torch.equal(r["seen"][step][1], results[0]["seen"][step][1]) for r in results), j
    assert not torch.equal(results[0]["seen"][WARMUP + 2][1], results[1]["seen"][WARMUP + 2][1])


def test_what_a_coded_warm_up_left_enters_the_first_synchronisation_times_its_rate():
    """The workers' residual and the two-stage exchange's server chunks hold gradient mass in a
    coded warm-up; at the first compressed step both become ``gamma r`` (the accumulated
    update's units), once: a later step leaves them to error feedback."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    params = list(model.parameters())
    numbers = {id(p): i for i, p in enumerate(params)}
    method = ZeroOneAdamStep(optimizer, numbers, warmup_steps=1, local_steps=(2, 4))
    store, key, n = TensorStore(), (0, 1, 2, 3), sum(p.numel() for p in params)
    left = {table: torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, table in enumerate(LEFT)}
    for table, tensor in left.items():
        store.put(table, key, tensor.clone())
    gradient = torch.randn(n, generator=torch.Generator().manual_seed(7))
    method.accumulate(store, key, gradient, params, syncing=True)
    for table, tensor in left.items():
        assert torch.equal(store.get(table, key), tensor * 0.003), table
    method.accumulate(store, key, gradient, params, syncing=True)
    for table, tensor in left.items():
        assert torch.equal(store.get(table, key), tensor * 0.003), table
    method.detach()
