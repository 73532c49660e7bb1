"""gradsift.DeMo (gradsift/frontends/decoupled_momentum.py): DeMo's step against its definition.

The oracle is DeMo written out here, tile by tile, with SciPy's orthonormal DCT
(``scipy.fft.dctn(..., norm="ortho")``) and a sort for the top-k: the momentum
``delta = beta delta + g_k``, per chunk the ``topk`` largest coefficients ``q_k``,
``delta -= IDCT(q_k)``, ``theta = theta (1 - lr wd) - lr sign(IDCT(mean_k q_k))``. One
process (no collective) and two gloo ranks (against the two workers' math simulated in
this process) must match it; the ranks must agree bit for bit, a run must resume bit for
bit, a dead peer must raise within seconds and bad arguments must say what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch

import gradsift
from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError, WireFormatError
from support.distributed import run_workers
from support.exchanging import (
    SHAPES,
    assert_a_dead_peer_raises,
    assert_resumes_bit_for_bit,
    gradients,
    poisoned,
    start,
    trained,
)
from support.exchanging import dying_worker as dying_worker  # the ranks look it up by name

# support.exchanging's SHAPES: a matrix with padded tiles, a vector, a tensor cut into runs
CHUNK, TOPK, LR, DECAY, BETA, STEPS = 4, 3, 0.01, 0.1, 0.9, 3
SETTINGS = {"lr": LR, "weight_decay": DECAY, "beta": BETA, "chunk": CHUNK, "topk": TOPK}


def demo(params: list[torch.Tensor], **options) -> gradsift.DeMo:
    return gradsift.DeMo(params, **{**SETTINGS, **options})


# -- the oracle ---------------------------------------------------------------------------------
def tiles(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The 2-D view and the tile of a tensor: a matrix as it is, anything else as one row."""
    rows, cols = shape if len(shape) == 2 else (1, int(np.prod(shape)))
    return rows, cols, min(CHUNK, rows), min(CHUNK, cols)


def sent_coefficients(delta: np.ndarray, value_dtype: torch.dtype | None) -> np.ndarray:
    """Every tile's ``TOPK`` largest DCT coefficients (the rest zero), laid out tile by tile
    on the zero-padded 2-D view, rounded to the wire's dtype."""
    rows, cols, tr, tc = tiles(delta.shape)
    padded = np.zeros((-(-rows // tr) * tr, -(-cols // tc) * tc))
    padded[:rows, :cols] = delta.reshape(rows, cols)
    kept = np.zeros_like(padded)
    for r in range(0, padded.shape[0], tr):
        for c in range(0, padded.shape[1], tc):
            coefficients = scipy.fft.dctn(padded[r : r + tr, c : c + tc], norm="ortho").reshape(-1)
            top = np.argsort(-np.abs(coefficients))[: min(TOPK, tr * tc)]
            chosen = np.zeros_like(coefficients)
            chosen[top] = coefficients[top]
            kept[r : r + tr, c : c + tc] = chosen.reshape(tr, tc)
    if value_dtype is not None:
        kept = torch.from_numpy(kept).to(value_dtype).double().numpy()
    return kept


def inverse(coefficients: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows, cols, tr, tc = tiles(shape)
    out = np.zeros_like(coefficients)
    for r in range(0, coefficients.shape[0], tr):
        for c in range(0, coefficients.shape[1], tc):
            out[r : r + tr, c : c + tc] = scipy.fft.idctn(coefficients[r : r + tr, c : c + tc], norm="ortho")
    return out[:rows, :cols].reshape(shape)


def oracle(
    world: int, value_dtype: torch.dtype | None = None
) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """The parameters after ``STEPS`` steps of ``world`` workers started from rank 0's, and
    every worker's momentum."""
    thetas = [p.numpy() for p in start(0)]
    deltas = [[np.zeros(shape) for shape in SHAPES] for _ in range(world)]
    for step in range(STEPS):
        for i, shape in enumerate(SHAPES):
            sent = []
            for rank in range(world):
                deltas[rank][i] = BETA * deltas[rank][i] + gradients(rank, step)[i].numpy()
                q = sent_coefficients(deltas[rank][i], value_dtype)
                deltas[rank][i] = deltas[rank][i] - inverse(q, shape)
                sent.append(q)
            direction = np.sign(inverse(sum(sent) / world, shape))
            thetas[i] = thetas[i] * (1 - LR * DECAY) - LR * direction
    return thetas, deltas


#: Entries per step: the matrix 2 x 3 tiles, the vector 2 runs, the tensor's 30 elements 8 runs; 3 each.
ENTRIES = (6 + 2 + 8) * TOPK


@pytest.mark.parametrize("value_dtype", [None, "bf16"])
def test_one_process_follows_the_definition(value_dtype) -> None:
    params = [torch.nn.Parameter(p) for p in start(0)]
    optimizer = demo(params, value_dtype=value_dtype)
    trained(params, optimizer, 0, range(STEPS))
    thetas, deltas = oracle(1, torch.bfloat16 if value_dtype else None)
    for param, theta, delta in zip(params, thetas, deltas[0], strict=True):
        torch.testing.assert_close(param.detach(), torch.from_numpy(theta), rtol=0, atol=1e-12)
        torch.testing.assert_close(
            optimizer.state[param]["delta"], torch.from_numpy(delta), rtol=0, atol=1e-12
        )
    step = optimizer.stats()["step"]
    assert step["bytes_sent"] == ENTRIES * ((2 if value_dtype else 8) + 2)  # values + int16 indices
    assert step["bytes_received"] == 0 and step["dense_bytes"] == 8 * sum(p.numel() for p in params)
    assert step["density"] == pytest.approx(ENTRIES / sum(p.numel() for p in params))


def ranks_worker(rank: int, world: int) -> dict:
    params = [torch.nn.Parameter(p) for p in start(rank)]  # DeMo starts every rank from rank 0's
    optimizer = demo(params)
    trained(params, optimizer, rank, range(STEPS))
    return {
        "params": [p.detach() for p in params],
        "deltas": [optimizer.state[p]["delta"] for p in params],
        "stats": optimizer.stats(),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_follow_the_definition_and_agree_bit_for_bit() -> None:
    results = run_workers(__file__, "ranks_worker", 2, timeout=60)
    thetas, deltas = oracle(2)
    for rank, result in enumerate(results):
        for got, theta, delta, own in zip(
            result["params"], thetas, deltas[rank], result["deltas"], strict=True
        ):
            torch.testing.assert_close(got, torch.from_numpy(theta), rtol=0, atol=1e-12)
            torch.testing.assert_close(own, torch.from_numpy(delta), rtol=0, atol=1e-12)
        total = result["stats"]["total"]
        assert total["steps"] == STEPS and total["bytes_sent"] == STEPS * ENTRIES * (8 + 2)
        assert total["bytes_received"] == total["bytes_sent"]  # one other worker's message per step
    for got, other in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(got, other)


def test_a_run_resumes_bit_for_bit() -> None:
    assert_resumes_bit_for_bit(demo, {"lr": 1.0}, steps=5, cut=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dead_peer_raises_instead_of_hanging() -> None:
    assert_a_dead_peer_raises(__file__, "DeMo", SETTINGS)


def test_a_non_finite_gradient_raises_before_any_parameter_moves() -> None:
    params, optimizer, before = poisoned(demo, float("nan"))
    with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all("delta" not in optimizer.state[p] for p in params)  # no momentum kept either


def refusing_worker(rank: int, world: int) -> dict:
    """Step 0; step 1 refused twice -- rank 1 sends an index outside its chunk, then a NaN --
    then taken; step 2. What each refusal said and left, the end state, and the count of
    collective handles kept over 500 more steps."""
    from gradsift.core.collectives import KEPT_WORKS

    params = [torch.nn.Parameter(p) for p in start(rank)]
    optimizer = demo(params)
    trained(params, optimizer, rank, range(1))
    compress = optimizer._compress

    def corrupt_index():
        message, deltas = compress()
        indices = message[optimizer.values_bytes :].clone().view(optimizer.index_dtype)
        indices[5] = CHUNK * CHUNK  # one past the last position of a 4 x 4 tile
        message[optimizer.values_bytes :] = indices.view(torch.uint8)
        return message, deltas

    refusals = []
    for case, error_type in ((corrupt_index, WireFormatError), (None, NonFiniteGradientError)):
        for param, grad in zip(params, gradients(rank, 1), strict=True):
            param.grad = grad
        if rank == 1 and case is not None:
            optimizer._compress = case
        if rank == 1 and case is None:
            params[2].grad[0, 1, 2] = float("inf")
        before = ([p.detach().clone() for p in params], [optimizer.state[p]["delta"].clone() for p in params])
        try:
            optimizer.step()
            refusals.append({"error": None})
        except error_type as error:
            refusals.append({
                "error": str(error),
                "params_kept": all(torch.equal(p, b) for p, b in zip(params, before[0], strict=True)),
                "momentum_kept": all(torch.equal(optimizer.state[p]["delta"], b)
                                     for p, b in zip(params, before[1], strict=True)),
            })  # fmt: skip
        optimizer._compress = compress
    trained(params, optimizer, rank, range(1, STEPS))
    end = {
        "params": [p.detach().clone() for p in params],
        "deltas": [optimizer.state[p]["delta"].clone() for p in params],
    }
    kept = []
    for step in range(STEPS, STEPS + 500):
        trained(params, optimizer, rank, range(step, step + 1))
        kept.append(len(KEPT_WORKS.works))
    return {"refusals": refusals, **end, "kept": kept}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_refused_step_moves_nothing_and_works_are_released_every_step() -> None:
    results = run_workers(__file__, "refusing_worker", 2, timeout=120)
    for rank, result in enumerate(results):
        wire, nonfinite = result["refusals"]
        assert "rank(s) [1] sent coefficient indices outside their chunk" in wire["error"], rank
        assert "rank(s) [1] sent NaN or Inf" in nonfinite["error"], rank
        for refusal in (wire, nonfinite):
            assert "no parameter and no momentum moved, on any rank" in refusal["error"]
            assert refusal["params_kept"] and refusal["momentum_kept"], (rank, refusal)
    # the refused steps left no trace: the run is the definition's 3 steps
    thetas, deltas = oracle(2)
    for rank, result in enumerate(results):
        for got, theta, own, delta in zip(
            result["params"], thetas, result["deltas"], deltas[rank], strict=True
        ):
            torch.testing.assert_close(got, torch.from_numpy(theta), rtol=0, atol=1e-12)
            torch.testing.assert_close(own, torch.from_numpy(delta), rtol=0, atol=1e-12)
        # the last step's all-gather only, every step (the old code kept one more per step)
        assert set(result["kept"]) == {1}, (rank, result["kept"][:3], result["kept"][-3:])


def test_under_propagate_an_index_outside_its_chunk_is_dropped() -> None:
    params = [torch.nn.Parameter(p) for p in start(0)]
    optimizer = demo(params, nonfinite="propagate")
    for param, grad in zip(params, gradients(0, 0), strict=True):
        param.grad = grad
    message, _ = optimizer._compress()
    bad = message.clone()
    indices = bad[optimizer.values_bytes :].clone().view(optimizer.index_dtype)
    indices[[0, 7]] = torch.tensor([-1, 10_000], dtype=optimizer.index_dtype)
    bad[optimizer.values_bytes :] = indices.view(torch.uint8)
    values, got = optimizer._received([message, bad])
    sent = message[: optimizer.values_bytes].clone().view(optimizer.value_dtype)
    own = message[optimizer.values_bytes :].clone().view(optimizer.index_dtype).int()
    assert torch.equal(got[0], own) and torch.equal(got[1, 1:7], own[1:7])
    assert got[1, 0] == 0 and got[1, 7] == 0 and values[1, 0] == 0 and values[1, 7] == 0
    assert torch.equal(values[1, 1:7], sent[1:7]) and torch.equal(values[0], sent)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"beta": 1.0}, "beta must lie in"),
        ({"chunk": 0}, "chunk must lie in"),
        ({"topk": 17}, r"topk must lie in \[1, 16\], the coefficients of a 4 x 4 chunk, got 17"),
        ({"topk": 0}, r"topk must lie in \[1, inf\), got 0"),
        ({"value_dtype": "int8"}, "value_dtype must be one of"),
        ({"nonfinite": "skip"}, "nonfinite must be one of"),
        ({"ratio": 0.01}, "DeMo has no option ratio; its options are: beta, chunk, topk"),
        ({"lr": 0.0}, "lr must lie in"),
        ({"weight_decay": -0.1}, "weight_decay must lie in"),
    ],
)
def test_bad_arguments_say_what_is_wrong(options, message) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        demo([torch.nn.Parameter(p) for p in start(0)], **options)


def test_a_small_chunk_names_the_default_topk_it_cannot_hold() -> None:
    with pytest.raises(
        InvalidOptionError, match=r"got 32 \(the default is 32: with chunk=4 pass topk= too\)"
    ):
        gradsift.DeMo([torch.nn.Parameter(torch.zeros(8, 8))], chunk=4)
