"""``blockquant`` (gradsift/compressors/blockquant.py) against its definition, and quantized
periodic averaging (``gradsift.diloco(..., compressor="blockquant")``) against the method
written out here, in real gloo processes: every worker's pseudo-gradient plus its decayed
residual, quantized block by block, averaged; the residual keeps what the codes missed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import gradsift
from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError
from support.diloco import INNER_LR, inner, survivors_raised, trained
from support.diloco import dying_worker as dying_worker  # the ranks look it up by name
from support.distributed import run_workers
from support.models import flat_params, make_model
from support.oracles import quantized_by_definition


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel,block", [(1, 64), (100, 16), (257, 64), (64, 64)])
def test_codes_decode_to_the_definition(bits: int, numel: int, block: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + bits)) * 3
    compressor = gradsift.get_compressor("blockquant", bits=bits, block_size=block)
    payload = compressor.compress(x)
    decoded = compressor.decompress([payload], numel)
    torch.testing.assert_close(decoded, quantized_by_definition(x, bits, block), rtol=0, atol=0)
    assert payload.nbytes == math.ceil(numel * bits / 8) + 4 * math.ceil(numel / block)


@pytest.mark.parametrize("name,option", [("blockquant", "block_size"), ("qsgd", "bucket_size")])
def test_a_block_longer_than_the_tensor_is_the_tensor(name: str, option: str) -> None:
    """One scale for the whole tensor, nothing padded: ``2**70`` was an overflow in ``torch.empty``,
    and ``10**9`` padded a 1,000-value tensor to 4 GB."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payloads = {
        size: gradsift.get_compressor(name, **{option: size}).compress(x) for size in (1000, 10**9, 2**70)
    }
    decoded = {
        size: gradsift.get_compressor(name, **{option: size}).decompress([p], 1000)
        for size, p in payloads.items()
    }
    for size in (10**9, 2**70):
        assert torch.equal(decoded[size], decoded[1000]) and payloads[size].nbytes == payloads[1000].nbytes


def test_the_mean_of_two_workers_is_the_mean_of_their_decodings() -> None:
    compressor = gradsift.get_compressor("blockquant", bits=4, block_size=8)
    a, b = torch.randn(50), torch.randn(50) * 10
    payloads = [compressor.compress(a), compressor.compress(b)]
    expected = (quantized_by_definition(a, 4, 8) + quantized_by_definition(b, 4, 8)) / 2
    torch.testing.assert_close(compressor.decompress(payloads, 50), expected)


def test_two_bits_are_ternary_and_the_method_runs_with_error_feedback() -> None:
    compressor = gradsift.get_compressor("blockquant", bits=2, block_size=4)
    decoded = compressor.decompress([compressor.compress(torch.tensor([2.0, -1.5, 0.9, 0.1]))], 4)
    assert decoded.tolist() == [2.0, -2.0, 0.0, 0.0]
    assert compressor.error_feedback  # deterministic rounding is biased


@pytest.mark.parametrize("options", [{"bits": 3}, {"bits": True}, {"bits": "4"}, {"block_size": 0}])
def test_bad_options_are_named(options: dict) -> None:
    with pytest.raises(InvalidOptionError, match=next(iter(options))):
        gradsift.get_compressor("blockquant", **options)


def test_a_non_finite_input_is_refused() -> None:
    with pytest.raises(NonFiniteGradientError):
        gradsift.get_compressor("blockquant").compress(torch.tensor([1.0, float("inf"), 0.0]))


#: Plain error feedback (beta 1): with a decay, ``c`` rounds once fused and twice written out, and
#: one code near a rounding tie may differ (the decay itself: tests/hook/test_feedback_reference.py).
H, ROUNDS, BITS, BLOCK, DECAY = 3, 4, 4, 16, 1.0


def written_out(rank: int, world: int, in_model: bool = False) -> list[torch.Tensor]:
    """Quantized periodic averaging by hand: ``c = Delta + beta r``, ``q = Q(c)``,
    ``theta <- theta - mean_w q_w`` (outer lr 1, no momentum), ``r <- c - q``; the worker's
    parameters after each round (``theta``; with ``in_model``, CocktailSGD's way, ``theta - r``
    with ``r`` then kept nowhere else)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    shared = flat_params(model).clone()
    residual = torch.zeros_like(shared)
    rounds = []
    for step in range(H * ROUNDS):
        inner(model, optimizer, rank, step)
        if (step + 1) % H == 0:
            compensated = (shared - flat_params(model)) + DECAY * residual
            sent = quantized_by_definition(compensated, BITS, BLOCK)
            residual = compensated - sent
            mean = sent.clone()
            dist.all_reduce(mean)
            shared = shared - mean / world
            restart = shared - residual if in_model else shared
            residual = torch.zeros_like(residual) if in_model else residual
            with torch.no_grad():
                for param, piece in zip(
                    model.parameters(), restart.split([p.numel() for p in model.parameters()]), strict=True
                ):
                    param.copy_(piece.view_as(param))
            rounds.append(restart.clone())
    return rounds


def with_gradsift(
    rank: int, resume_at: int | None = None, unsent: str = "residual"
) -> tuple[list[torch.Tensor], dict]:
    rounds, state = trained(
        lambda model, optimizer: gradsift.diloco(
            model, optimizer, sync_every=H, compressor="blockquant", bits=BITS, block_size=BLOCK, residual_decay=DECAY, unsent=unsent
        ),
        rank, H * ROUNDS, H, resume_at=resume_at,
    )  # fmt: skip
    return rounds, state.stats()


def averaging_worker(rank: int, world: int) -> dict:
    expected = written_out(rank, world)
    got, stats = with_gradsift(rank)
    resumed, _ = with_gradsift(rank, resume_at=H + 1)
    in_model, _ = with_gradsift(rank, unsent="model")
    return {"expected": expected, "got": got, "resumed": resumed, "stats": stats,
            "expected_in_model": written_out(rank, world, in_model=True), "in_model": in_model}  # fmt: skip


def unsent_refusal_worker(rank: int, world: int) -> str:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    try:
        gradsift.diloco(model, optimizer, compressor="blockquant", unsent="model")  # decay 0.95
    except InvalidOptionError as error:
        return str(error)
    return ""


@pytest.mark.distributed
@pytest.mark.slow
def test_unsent_in_the_model_needs_plain_error_feedback() -> None:
    (message,) = run_workers(__file__, "unsent_refusal_worker", 1)
    assert "residual_decay=1.0" in message


@pytest.mark.distributed
@pytest.mark.slow
def test_quantized_averaging_is_the_method_written_out_and_resumes_bit_for_bit() -> None:
    for result in run_workers(__file__, "averaging_worker", 2, timeout=120):
        for got, expected in zip(result["got"], result["expected"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for got, expected in zip(result["in_model"], result["expected_in_model"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # unsent="model"
        assert not torch.equal(result["in_model"][-1], result["got"][-1])
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["got"], strict=True))
        total = result["stats"]["total"]
        numel = sum(p.numel() for p in make_model().parameters())
        sent = math.ceil(numel * BITS / 8) + 4 * math.ceil(numel / BLOCK)
        # one payload per round, plus the allgather message's framing (one 4-byte header word)
        assert ROUNDS * sent < total["bytes_sent"] <= ROUNDS * (sent + 8)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dead_peer_raises_instead_of_hanging() -> None:
    results = run_workers(
        __file__, "dying_worker", 2, group_timeout=10.0, timeout=60, expect_exit={1: 3},
        sync_every=H, adamw=False, compressor="blockquant",
    )  # fmt: skip
    assert survivors_raised(results, 2)
