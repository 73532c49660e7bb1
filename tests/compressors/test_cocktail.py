"""``cocktail`` (gradsift/compressors/cocktail.py) against CocktailSGD's compressor written out,
and per-step delta sync (``gradsift.diloco(..., compressor="cocktail", sync_every=1)``) in real
gloo processes: rounds agree on every rank, resume bit for bit, a dead peer raises."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradsift
from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.hook.feedback import RESIDUAL, ErrorFeedback
from support.diloco import dying_worker as dying_worker  # the ranks look it up by name
from support.diloco import survivors_raised, trained
from support.distributed import run_workers
from support.oracles import quantized_by_definition


def subsets(compressor, numel: int) -> list[set[int]]:
    """The positions each call of one period may select: those of its slot."""
    slots = compressor.slots(numel, torch.device("cpu")).tolist()
    return [{i for i, s in enumerate(slots) if s == phase} for phase in range(compressor.period)]


def test_the_subsets_of_one_period_partition_the_positions_and_are_shared() -> None:
    a, b = gradsift.get_compressor("cocktail", subset=0.25), gradsift.get_compressor("cocktail", subset=0.25)
    parts = subsets(a, 1000)
    assert len(parts) == 4 and set().union(*parts) == set(range(1000)) and sum(map(len, parts)) == 1000
    assert all(150 < len(part) < 350 for part in parts)  # random slots: about n/4 each
    assert parts == subsets(b, 1000)  # the same seed on every worker
    assert parts != subsets(gradsift.get_compressor("cocktail", subset=0.25, seed=1), 1000)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_each_call_sends_the_top_k_of_its_subset_quantized_by_blocks(bits: int) -> None:
    n, subset, topk, block = 2000, 0.2, 0.25, 16
    compressor = gradsift.get_compressor("cocktail", subset=subset, topk=topk, bits=bits, block_size=block)
    parts = subsets(compressor, n)
    k = max(1, int(n * subset * topk))
    for call in range(7):  # more than a period: the subsets roll
        x = torch.randn(n, generator=torch.Generator().manual_seed(call))
        payload = compressor.compress(x, key="bucket")
        eligible = sorted(parts[call % compressor.period], key=lambda i: -abs(float(x[i])))
        expected = sorted(eligible[:k])
        assert payload.indices.tolist() == expected
        decoded = compressor.decompress([payload], n)
        wanted = torch.zeros(n)
        wanted[expected] = quantized_by_definition(x[expected], bits, block)
        torch.testing.assert_close(decoded, wanted, rtol=0, atol=0)
        assert payload.nbytes == 4 * k + math.ceil(k * bits / 8) + 4 * math.ceil(k / block) + 4
    assert compressor.state_dict() == {"calls": {"bucket": 7}}


def test_a_tensor_the_cpu_selects_by_radix_sends_the_top_k_of_its_subset() -> None:
    """Above ``largest.ONE_TOPK_BELOW`` the CPU selects with the radix select: still the ``k``
    largest magnitudes of the call's subset (brute force: its positions sorted by magnitude)."""
    from gradsift.compressors.largest import ONE_TOPK_BELOW

    n = ONE_TOPK_BELOW + 4321
    compressor = gradsift.get_compressor("cocktail", subset=0.1, topk=0.2)
    slots = compressor.slots(n, torch.device("cpu"))
    k = int(n * 0.1 * 0.2)
    for call in range(2):
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 + call))
        payload = compressor.compress(x, key="bucket")
        eligible = torch.nonzero(slots == call % compressor.period).view(-1)
        order = torch.argsort(x[eligible].abs(), descending=True, stable=True)
        assert payload.indices.tolist() == sorted(eligible[order[:k]].tolist())


def test_the_mean_of_two_workers_and_what_error_feedback_keeps() -> None:
    compressor = gradsift.get_compressor("cocktail", subset=0.5, topk=0.5)
    x, y = torch.randn(400), torch.randn(400) * 3
    px = compressor.compress(x, key=1)
    compressor.load_state_dict({"calls": {1: 0}})  # the other worker's same call
    py = compressor.compress(y, key=1)
    torch.testing.assert_close(
        compressor.decompress([px, py], 400), (compressor.sent_dense(px) + compressor.sent_dense(py)) / 2
    )
    feedback = ErrorFeedback()
    feedback.update(0, x.clone(), px, compressor)
    residual = feedback.store.get(RESIDUAL, 0)
    torch.testing.assert_close(residual, x - compressor.sent_dense(px))  # the rounding error stays too
    sent = px.indices
    assert not torch.equal(residual[sent], torch.zeros(len(sent)))  # 4-bit values are not exact


def test_a_bucket_selects_and_codes_alike_in_any_layout() -> None:
    """DDP lays a bucket's parameters out in one order before its rebuild and another after it
    (and in the first again when a run resumes): the same parameters in three layouts, over a
    whole period of calls, decode to the same bits at every parameter -- the slots, the top-k
    and the blocks that share a scale follow the parameters, not the layout (a resumed run
    repeats the uninterrupted one)."""
    numels = {0: 300, 1: 37, 2: 150, 3: 1}
    gen = torch.Generator().manual_seed(3)
    grads = [{i: torch.randn(n, generator=gen) for i, n in numels.items()} for _ in range(4)]
    key = tuple(sorted(numels))
    decoded = {}
    for order in [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)]:
        compressor = gradsift.get_compressor("cocktail", subset=0.25, topk=0.5, block_size=16)
        compressor.store.follow(key, order, numels)
        calls = []
        for grad in grads:  # one period: each call has its own subset
            flat = torch.cat([grad[i] for i in order])
            mean = compressor.decompress([compressor.compress(flat, key=key)], flat.numel())
            calls.append(dict(zip(order, mean.split([numels[i] for i in order]), strict=True)))
        decoded[order] = calls
    first = decoded[(0, 1, 2, 3)]
    for calls in decoded.values():
        for call, reference in zip(calls, first, strict=True):
            assert all(torch.equal(call[i], reference[i]) for i in numels)


def test_a_nan_outside_the_subset_is_still_flagged() -> None:
    compressor = gradsift.get_compressor("cocktail", subset=0.5)
    x = torch.randn(100)
    outside = next(iter(subsets(compressor, 100)[1]))  # not eligible at call 0
    x[outside] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        compressor.compress(x)
    assert compressor.state_dict() == {"calls": {}}  # the refused call left no trace


@pytest.mark.parametrize(
    "options",
    [{"subset": 0.001}, {"subset": 0.0}, {"topk": 1.5}, {"bits": 3}, {"block_size": 0}, {"seed": -1}],
)
def test_bad_options_are_named(options: dict) -> None:
    with pytest.raises(InvalidOptionError, match=next(iter(options))):
        gradsift.get_compressor("cocktail", **options)


H, ROUNDS = 1, 8


def per_step_sync(rank: int, resume_at: int | None = None) -> tuple[list[torch.Tensor], dict]:
    rounds, state = trained(
        lambda model, optimizer: gradsift.diloco(
            model, optimizer, sync_every=H, compressor="cocktail", subset=0.5, topk=0.4
        ),
        rank, ROUNDS, H, adamw=True, resume_at=resume_at,
    )  # fmt: skip
    return rounds, state.stats()


def delta_sync_worker(rank: int, world: int) -> dict:
    whole, stats = per_step_sync(rank)
    resumed, _ = per_step_sync(rank, resume_at=3)
    return {"whole": whole, "resumed": resumed, "stats": stats}


@pytest.mark.distributed
@pytest.mark.slow
def test_per_step_delta_sync_agrees_on_every_rank_and_resumes_bit_for_bit() -> None:
    results = run_workers(__file__, "delta_sync_worker", 2, timeout=120)
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["whole"], strict=True))
        total = result["stats"]["total"]
        assert total["steps"] == ROUNDS and 0 < total["bytes_sent"] < total["dense_bytes"] / 4
    first, second = (r["whole"] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # the shared parameters
    assert all(float((b - a).norm()) > 0 for a, b in itertools.pairwise(first))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dead_peer_raises_instead_of_hanging() -> None:
    results = run_workers(
        __file__, "dying_worker", 2, group_timeout=10.0, timeout=60, expect_exit={1: 3},
        sync_every=1, adamw=True, compressor="cocktail",
    )  # fmt: skip
    assert survivors_raised(results, 2)
