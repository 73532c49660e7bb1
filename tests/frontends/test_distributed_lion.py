"""gradsift.DistributedLion (gradsift/frontends/distributed_lion.py): the step against its definition.

The oracle is Distributed Lion written out here in NumPy (float64), worker by worker:
``u_k = sign(beta1 m_k + (1 - beta1) g_k)`` with ``sign(0) = +1``,
``m_k = beta2 m_k + (1 - beta2) g_k``, ``S = sum_k u_k``, ``U = sign(S)`` (a tie gives 0) or
``S / W``, ``theta = theta - lr (U + wd theta)``. One process, and two and four gloo ranks
(against the workers' math simulated in this process), must match it; the ranks must agree
bit for bit, a run must resume bit for bit, a dead peer must raise within seconds, a NaN on
one rank must skip the step on every rank, bad settings must say what is wrong, and the
bytes counted must be the message's: ``ceil(n / 8) + 1`` sent, ``(W-1)`` of them received.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train.config import TrainConfig
from support import exchanging as shared
from support.distributed import run_workers
from support.exchanging import SHAPES, gradients, start, trained
from support.exchanging import dying_worker as dying_worker  # the ranks look it up by name

LR, DECAY, BETAS, STEPS = 0.01, 0.1, (0.9, 0.99), 4
SETTINGS = {"lr": LR, "weight_decay": DECAY, "betas": BETAS}
ELEMENTS = sum(math.prod(shape) for shape in SHAPES)
MESSAGE = math.ceil(ELEMENTS / 8) + 1  # the bits, then the non-finite flag


def lion(params: list[torch.Tensor], **options) -> gradsift.DistributedLion:
    return gradsift.DistributedLion(params, **{**SETTINGS, **options})


def oracle(world: int, aggregate: str, steps: int = STEPS) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """The parameters after ``steps`` steps of ``world`` workers started from rank 0's, and
    every worker's momentum."""
    beta1, beta2 = BETAS
    thetas = [p.numpy() for p in start(0)]
    momenta = [[np.zeros(shape) for shape in SHAPES] for _ in range(world)]
    for step in range(steps):
        for i in range(len(SHAPES)):
            signs = []
            for rank in range(world):
                g = gradients(rank, step)[i].numpy()
                direction = beta1 * momenta[rank][i] + (1 - beta1) * g
                zero = 1.0 if (rank + step) % 2 == 0 else -1.0  # sign(0) by rank and step
                signs.append(np.where(direction > 0, 1.0, np.where(direction < 0, -1.0, zero)))
                momenta[rank][i] = beta2 * momenta[rank][i] + (1 - beta2) * g
            total = sum(signs)
            update = np.sign(total) if aggregate == "vote" else total / world
            thetas[i] = thetas[i] - LR * (update + DECAY * thetas[i])
    return thetas, momenta


def assert_follows(params, momenta, thetas, expected) -> None:
    for got, theta, own, momentum in zip(params, thetas, momenta, expected, strict=True):
        torch.testing.assert_close(got, torch.from_numpy(theta), rtol=0, atol=1e-12)
        torch.testing.assert_close(own, torch.from_numpy(momentum), rtol=0, atol=1e-12)


@pytest.mark.parametrize("aggregate", ["average", "vote"])
def test_one_worker_is_lion(aggregate) -> None:
    params = [torch.nn.Parameter(p) for p in start(0)]
    optimizer = lion(params, aggregate=aggregate)
    trained(params, optimizer, 0, range(STEPS))
    thetas, momenta = oracle(1, aggregate)
    assert_follows([p.detach() for p in params], [optimizer.state[p]["momentum"] for p in params],
                   thetas, momenta[0])  # fmt: skip
    step = optimizer.stats()["step"]
    assert step["bytes_sent"] == MESSAGE and step["bytes_received"] == 0
    assert step["dense_bytes"] == 8 * ELEMENTS and step["density"] == 1.0 and not step["skipped"]


def test_a_zero_direction_alternates_its_sign_and_goes_nowhere() -> None:
    """``sign(0)`` is ``+1`` on even ``rank + step`` and ``-1`` on odd: one worker whose direction
    stays zero (no gradient, no momentum) steps down by ``lr``, then back up, and never drifts
    (a sign of ``+1`` for every zero stepped it down by ``lr`` on every step)."""
    param = torch.nn.Parameter(torch.zeros(11, dtype=torch.float64))
    optimizer = gradsift.DistributedLion([param], lr=LR)
    for step in range(6):
        param.grad = None if step % 2 else torch.zeros_like(param)  # a missing .grad counts as zero
        optimizer.step()
        expected = -LR if step % 2 == 0 else 0.0
        assert torch.equal(param.detach(), torch.full((11,), expected, dtype=torch.float64)), step


def finished(params: list[torch.nn.Parameter], optimizer: gradsift.DistributedLion) -> dict:
    """What a rank hands back: its parameters, momenta and numbers."""
    momenta = [optimizer.state[p]["momentum"] for p in params]
    return {"params": [p.detach() for p in params], "momenta": momenta, "stats": optimizer.stats()}


def ranks_worker(rank: int, world: int) -> dict:
    """Both aggregates, each on its own copy of the parameters, started from this rank's own
    values (the optimizer starts every rank from rank 0's)."""
    results = {}
    for aggregate in ("vote", "average"):
        params = [torch.nn.Parameter(p) for p in start(rank)]
        optimizer = lion(params, aggregate=aggregate)
        trained(params, optimizer, rank, range(STEPS))
        results[aggregate] = finished(params, optimizer)
    return results


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_follow_the_definition_agree_bit_for_bit_and_count_their_bytes(world) -> None:
    results = run_workers(__file__, "ranks_worker", world, timeout=120)
    # at 2 workers about half the elements tie (S = 0): the vote moves them by the decay alone
    for aggregate in ("vote", "average"):
        thetas, momenta = oracle(world, aggregate)
        for rank, result in enumerate(results):
            got = result[aggregate]
            assert_follows(got["params"], got["momenta"], thetas, momenta[rank])
            total = got["stats"]["total"]
            assert total["steps"] == STEPS and total["bytes_sent"] == STEPS * MESSAGE
            assert total["bytes_received"] == (world - 1) * STEPS * MESSAGE  # an all-gather's
            assert total["dense_bytes"] == STEPS * 8 * ELEMENTS and total["skipped_steps"] == 0
        for result in results[1:]:
            for a, b in zip(results[0][aggregate]["params"], result[aggregate]["params"], strict=True):
                assert torch.equal(a, b)


def test_a_run_resumes_bit_for_bit() -> None:
    shared.assert_resumes_bit_for_bit(lion, {"lr": 1.0, "betas": (0.5, 0.5)}, steps=6, cut=3)
    with pytest.raises(InvalidOptionError, match="not a DistributedLion state dict: it has no 'lion' entry"):
        lion([torch.nn.Parameter(p) for p in start(0)]).load_state_dict(
            gradsift.DeMo([torch.nn.Parameter(p) for p in start(0)]).state_dict()
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dead_peer_raises_instead_of_hanging() -> None:
    shared.assert_a_dead_peer_raises(__file__, "DistributedLion", SETTINGS)


def skipping_worker(rank: int, world: int) -> dict:
    """Step 0; then rank 1's gradient holds a NaN: the step is skipped on every rank; then
    steps 1 to ``STEPS - 1`` on finite gradients."""
    params = [torch.nn.Parameter(p) for p in start(rank)]
    optimizer = lion(params)
    trained(params, optimizer, rank, range(1))
    for param, grad in zip(params, gradients(rank, 1), strict=True):
        param.grad = grad
    if rank == 1:
        params[2].grad[0, 1, 2] = float("nan")
    before = ([p.detach().clone() for p in params], [optimizer.state[p]["momentum"].clone() for p in params])
    optimizer.step()
    skipped = {
        "stats": optimizer.stats(),
        "params_kept": all(torch.equal(p, b) for p, b in zip(params, before[0], strict=True)),
        "momentum_kept": all(torch.equal(optimizer.state[p]["momentum"], b)
                             for p, b in zip(params, before[1], strict=True)),
    }  # fmt: skip
    trained(params, optimizer, rank, range(1, STEPS))
    return {"skipped": skipped, **finished(params, optimizer)}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank() -> None:
    results = run_workers(__file__, "skipping_worker", 2, timeout=60)
    thetas, momenta = oracle(2, "vote")
    for rank, result in enumerate(results):
        skipped = result["skipped"]
        assert skipped["params_kept"] and skipped["momentum_kept"], rank
        assert skipped["stats"]["step"]["skipped"] and skipped["stats"]["total"]["skipped_steps"] == 1
        # the skipped step left no trace: the run is the definition's steps
        assert_follows(result["params"], result["momenta"], thetas, momenta[rank])
        assert result["stats"]["total"]["steps"] == STEPS + 1
        assert result["stats"]["total"]["bytes_received"] == (STEPS + 1) * MESSAGE  # the skipped step's too


def test_a_non_finite_gradient_alone_moves_nothing() -> None:
    params, optimizer, before = shared.poisoned(lion, float("inf"))
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all("momentum" not in optimizer.state[p] for p in params)
    assert optimizer.stats()["step"]["skipped"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"betas": (1.0, 0.99)}, "betas must lie in"),
        ({"betas": (0.9,)}, "betas must be two numbers"),
        ({"aggregate": "median"}, "aggregate must be one of vote, average"),
        ({"nonfinite": "raise"}, "DistributedLion has no option nonfinite; its options are: aggregate"),
        ({"lr": 0.0}, "lr must lie in"),
        ({"weight_decay": -0.1}, "weight_decay must lie in"),
    ],
)
def test_bad_arguments_say_what_is_wrong(options, message) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        lion([torch.nn.Parameter(p) for p in start(0)], **options)


def test_a_group_added_later_is_refused_and_a_group_betas_checked() -> None:
    params = [torch.nn.Parameter(p) for p in start(0)]
    with pytest.raises(InvalidOptionError, match="betas must lie in"):
        gradsift.DistributedLion([{"params": params[:1], "betas": (0.9, 1.5)}, {"params": params[1:]}])
    optimizer = lion(params[:2])
    with pytest.raises(InvalidOptionError, match="parameters are fixed at construction"):
        optimizer.add_param_group({"params": params[2:]})


@pytest.mark.parametrize(
    ("optimizer", "defaults", "foreign", "method"),
    [("demo", (1e-3, 0.0), "warmup_steps", "DeMo"), ("lion", (3e-4, 1.0), "topk", "DistributedLion")],
)
def test_the_trainer_refuses_what_does_not_apply_to_an_optimizer_that_exchanges(
    tmp_path, optimizer, defaults, foreign, method
) -> None:
    """DeMo's defaults: a third of AdamW's lr, no decay; Lion's: a tenth of its lr, ten times its decay."""

    def config(**settings):
        return TrainConfig(out=str(tmp_path), model="gpt", optimizer=optimizer, **settings)

    default = config()
    assert (default.lr, default.weight_decay) == defaults
    with pytest.raises(InvalidOptionError, match="--compressor must be none"):
        config(compressor="topk", options={"ratio": 0.01})
    with pytest.raises(InvalidOptionError, match="--sync-every"):
        config(sync_every=10)
    with pytest.raises(InvalidOptionError, match=f"{method} has no option {foreign}"):
        config(options={foreign: 10})


def test_the_trainer_takes_lion_s_aggregate() -> None:
    assert TrainConfig(
        out="unused", model="gpt", optimizer="lion", options={"aggregate": "average"}
    ).options == {"aggregate": "average"}


def untouched_worker(rank: int, world: int) -> dict:
    """A parameter no worker has a gradient for, under both aggregates."""
    del rank, world
    results = {}
    for aggregate in ("vote", "average"):
        param = torch.nn.Parameter(torch.full((9,), 0.5, dtype=torch.float64))
        optimizer = gradsift.DistributedLion([param], lr=LR, aggregate=aggregate)
        for _ in range(5):
            optimizer.step()  # no .grad on any rank: every direction is zero
        results[aggregate] = param.detach().clone()
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_workers_an_element_no_worker_moves_stays_where_it_is() -> None:
    for result in run_workers(__file__, "untouched_worker", 2, timeout=120):
        for aggregate in ("vote", "average"):
            assert torch.equal(result[aggregate], torch.full((9,), 0.5, dtype=torch.float64)), aggregate
