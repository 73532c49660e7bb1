"""The two-stage compressed allreduce (gradsift.exchanges.two_stage) against its definition,
on 2 and 4 real gloo ranks.

Oracle, written out here from Tang et al.'s compressed allreduce with ``efsignsgd``'s code
``C(x) = (||x||_1 / d) sign(x)`` (``sign(0) = +1``), per layer (``granularity="layer"``:
one part per parameter, its elements in their own order): pad the worker's compensated
gradient ``c_k`` with zeros to ``W m`` (``m = ceil(n / W)``), cut it into ``W`` chunks;
``s^j = (1/W) sum_k C(c_k^j)``; the chunk's owner keeps ``e^j`` (zeros at first) and sends
``C(s^j + e^j)``, keeping ``e^j <- s^j + e^j - C(s^j + e^j)`` on the real elements; every
rank's gradient is the concatenation of those codes; worker ``k``'s residual is
``c_k - C(c_k^j)`` over its chunks. Also: the bytes every collective delivers (tallied
from the calls) equal the hook's ``bytes_received`` and stay 2 (W - 1)/W of one message,
and what it cannot carry is refused (a resume bit for bit and a dead peer: test_exchanges.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.exchanges.two_stage import SERVER_CHUNK
from support.distributed import run_workers
from support.models import batch, make_model
from support.tally import Tally

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 3


def code(x: torch.Tensor) -> torch.Tensor:
    """``efsignsgd``'s ``C(x)`` by its definition."""
    scale = x.abs().sum() / x.numel()
    return torch.where(x < 0, -scale, scale)


def big_step(rank: int) -> dict:
    """One step of a wider model (headers negligible), with the collectives tallied."""
    model = DDP(make_model((128, 512, 16)))
    state = gradsift.register_comm_hook(model, "efsignsgd", exchange="two-stage", optimizer=False)
    gen = torch.Generator().manual_seed(rank)
    with Tally() as tally:
        model(torch.randn(8, 128, generator=gen)).square().mean().backward()
    stats = state.stats()["step"]
    return {
        "tallied": tally.received, "received": stats["bytes_received"], "dense": stats["dense_bytes"],
        "density": stats["density"], "tensors": stats["compressed_tensors"],
    }  # fmt: skip


def worker(rank: int, world: int) -> dict:
    model = DDP(make_model())
    state = gradsift.register_comm_hook(
        model, "efsignsgd", exchange="two-stage", granularity="layer", optimizer=False
    )
    seen: dict = {}
    compensate = state.feedback.compensate

    def recording(key, gradient, out=None):
        seen[key] = compensate(key, gradient, out).clone()
        return seen[key].clone()

    state.feedback.compensate = recording
    numbers = [state.layout.numbers[id(p)] for p in model.module.parameters()]
    steps = []
    for step in range(STEPS):
        seen.clear()
        model.zero_grad()
        x, y = batch(rank, step)
        with Tally() as tally:
            torch.nn.functional.mse_loss(model(x), y).backward()
        stats = state.stats()["step"]
        steps.append({
            "grad": {n: p.grad.reshape(-1).clone() for n, p in zip(numbers, model.module.parameters(), strict=True)},
            "compensated": dict(seen),
            "residual": {k: v.clone() for k, v in state.store.table("residual").items()},
            "tallied": tally.received,
            "received": stats["bytes_received"],
            "dense": stats["dense_bytes"],
        })  # fmt: skip
    return {"steps": steps, "big": big_step(rank)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request):
    return run_workers(__file__, "worker", request.param, timeout=180)


@pytest.fixture
def runs(results):
    return [result["steps"] for result in results]


def test_the_mean_and_both_residuals_are_the_definition(runs):
    world = len(runs)
    server: dict = {}
    for step in range(STEPS):
        for key, c0 in runs[0][step]["compensated"].items():
            n = c0.numel()
            m = math.ceil(n / world)
            padded = [torch.nn.functional.pad(r[step]["compensated"][key], (0, world * m - n)) for r in runs]
            chunks = [p.split(m) for p in padded]
            delivered = []
            for j in range(world):
                mean = sum(code(chunks[k][j]) for k in range(world)) / world
                e = server.get((key, j), torch.zeros(m))
                coded = code(mean + e)
                kept = mean + e - coded
                kept[max(0, min(m, n - j * m)) :] = 0  # the padding's residual is not kept
                server[(key, j)] = kept
                delivered.append(coded)
            expected = torch.cat(delivered)[:n]
            for k, result in enumerate(runs):
                torch.testing.assert_close(result[step]["grad"][key], expected, rtol=1e-6, atol=1e-7)
                assert torch.equal(result[step]["grad"][key], runs[0][step]["grad"][key])  # replicated
                sent = torch.cat([code(chunk) for chunk in chunks[k]])[:n]
                torch.testing.assert_close(
                    result[step]["residual"][key], padded[k][:n] - sent, rtol=1e-6, atol=1e-7
                )


def test_bytes_received_are_a_ring_share_of_one_message_and_as_tallied(results):
    """1 bit per element, a scale per chunk, headers and padding: within 5 % of a ring
    allreduce's share, 2 (W - 1)/W, of the whole model's 1-bit code, at 2 and at 4 workers
    (the allgather's would be W - 1 whole messages)."""
    world = len(results)
    for result in results:
        for record in [*result["steps"], result["big"]]:
            assert record["received"] == record["tallied"]
        big = result["big"]
        assert big["received"] <= 1.05 * 2 * (world - 1) / world * big["dense"] / 32
        # every element coded once, counted once per bucket (the chunks' padding not among them)
        assert big["density"] == 1.0 and big["tensors"] == 1


def blockquant_worker(rank: int, world: int) -> dict:
    """4-bit block codes through both stages, beside stock DDP on the same batch (the true mean)
    and the allgather's one stage of the same codes."""
    grads = {}
    for name in ("none", "allgather", "two-stage"):
        model = DDP(make_model())
        if name != "none":
            gradsift.register_comm_hook(model, "blockquant", exchange=name, optimizer=False)
        x, y = batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
    return grads


def test_blockquant_travels_both_stages_replicated_and_near_the_mean():
    """The same bits on every rank; two roundings (the workers' codes, then the owner's code of
    their mean), each of the kind the allgather's one stage makes, so the error to the true mean
    is above zero and at most twice the allgather's."""
    results = run_workers(__file__, "blockquant_worker", 4, timeout=120)
    assert all(torch.equal(r["two-stage"], results[0]["two-stage"]) for r in results)
    truth = results[0]["none"]
    error = {name: (results[0][name] - truth).norm() for name in ("allgather", "two-stage")}
    assert 0 < error["two-stage"] <= 2 * error["allgather"]


def refusal_worker(rank: int, world: int) -> dict:
    model = DDP(make_model())
    out = {}
    for name, options in {"topk": {}, "server": {"server_feedback": True}}.items():
        try:
            compressor = "topk" if name == "topk" else "onebit"
            gradsift.register_comm_hook(model, compressor, exchange="two-stage", optimizer=False, **options)
            out[name] = None
        except gradsift.core.errors.InvalidOptionError as error:
            out[name] = str(error)
    return out


def test_what_it_cannot_carry_is_refused_by_name():
    (result,) = run_workers(__file__, "refusal_worker", 1)
    assert "cannot travel by exchange 'two-stage'" in result["topk"]
    assert "runs that server stage itself" in result["server"]


def nonfinite_worker(rank: int, world: int) -> dict:
    """A NaN in rank 1's gradient at step 2, after DDP's bucket rebuild (one chunk's owner
    learns of it in stage 1 and tells every rank in stage 2)."""
    model = DDP(make_model())
    state = gradsift.register_comm_hook(
        model, "efsignsgd", exchange="two-stage", optimizer=False, nonfinite="skip"
    )
    out = {}
    for step in range(4):
        model.zero_grad()
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * float("nan") if step == 2 and rank == 1 else loss).backward()
        out[step] = {
            "skipped": state.last_step_skipped,
            "grad": torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]),
            "store": {
                t: {k: v.clone() for k, v in state.store.table(t).items()} for t in ("residual", SERVER_CHUNK)
            },
        }
    return out


def test_a_non_finite_gradient_on_one_rank_drops_the_step_on_every_rank():
    results = run_workers(__file__, "nonfinite_worker", 4, timeout=120)
    for result in results:
        assert [result[step]["skipped"] for step in range(4)] == [False, False, True, False]
        assert torch.equal(result[2]["grad"], torch.zeros_like(result[2]["grad"]))  # the "skip" policy's fill
        for table in ("residual", SERVER_CHUNK):  # rolled back: as after step 1
            before, after = result[1]["store"][table], result[2]["store"][table]
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
