"""The DDP hook in real gloo processes: equality with stock DDP, every sparsifier,
granularity/min_numel/warm-up bytes, no_sync accumulation (non-finite steps: test_nonfinite.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.compressors import Sparsifier, compressor_class
from support.distributed import record_sparse_payloads, run_workers
from support.models import NUMELS, batch, flat_params, hooked, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# --- equality with stock DDP -------------------------------------------------------------
def equality_worker(rank: int, world: int) -> dict:
    out = {}
    stock = DDP(make_model())
    train(stock, rank, range(5))
    out["stock"] = flat_params(stock)
    model, state = hooked("none")
    train(model, rank, range(5))
    out["none"], out["none_steps"] = flat_params(model), state.step
    model, _ = hooked("topk", ratio=1.0)
    train(model, rank, range(5))
    out["topk1"] = flat_params(model)
    # no_sync: two accumulated micro-batches per synchronised step
    stock = DDP(make_model())
    train(stock, rank, range(3), micro=2)
    model, state = hooked("none")
    train(model, rank, range(3), micro=2)
    out["stock_accum"], out["none_accum"], out["accum_steps"] = (
        flat_params(stock),
        flat_params(model),
        state.step,
    )
    return out


def test_none_matches_stock_ddp_bit_for_bit_and_topk_ratio_one_matches_dense():
    for out in run_workers(__file__, "equality_worker", 2):
        assert torch.equal(out["none"], out["stock"])
        assert out["none_steps"] == 5
        torch.testing.assert_close(out["topk1"], out["stock"], rtol=1e-5, atol=1e-6)
        # no_sync: micro-batches accumulate locally, the hook runs once per synchronised
        # backward on the accumulated gradient, exactly like stock DDP
        assert torch.equal(out["none_accum"], out["stock_accum"])
        assert out["accum_steps"] == 3


def three_worker_equality_worker(rank: int, world: int) -> dict:
    stock = DDP(make_model())
    train(stock, rank, range(3))
    model, _ = hooked("none")
    train(model, rank, range(3))
    return {"stock": flat_params(stock), "none": flat_params(model)}


def test_none_matches_stock_ddp_bit_for_bit_at_three_workers():
    # Stock DDP multiplies each gradient by 1/W; at W = 3, g / 3 differs from g * (1/3) in
    # the last bit for some g, so only the same arithmetic keeps the equality exact.
    for out in run_workers(__file__, "three_worker_equality_worker", 3):
        assert torch.equal(out["none"], out["stock"])


# --- every sparsifier: identical parameters, aggregate == reference from gathered payloads ----
def sparsifier_names() -> list[str]:
    """The sparsifiers whose payload carries the selected values as they are (a density option
    sets them); cocktail's quantized values: tests/compressors/test_cocktail.py."""
    return [
        name
        for name in gradsift.available_compressors()
        if issubclass(cls := compressor_class(name), Sparsifier) and cls.density_option is not None
    ]


SPARSIFIER_OPTIONS = {"threshold": {"threshold": 0.05}}


def sparsifier_worker(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        options = SPARSIFIER_OPTIONS.get(name, {"ratio": 0.1})
        model, state = hooked(name, **options)
        train(model, rank, range(3))
        # one more step, recording the payloads this rank really compressed
        sent = record_sparse_payloads(state.compressor)
        model.zero_grad()
        x, y = batch(rank, 99)
        torch.nn.functional.mse_loss(model(x), y).backward()
        everyone = [None] * world
        dist.all_gather_object(everyone, sent)
        reference = torch.zeros(sum(NUMELS), dtype=torch.float64)
        for payloads in everyone:
            ((key, (indices, values, numel)),) = payloads.items()  # one bucket: key = its parameter numbers
            assert sorted(key) == [0, 1, 2, 3] and numel == reference.numel()
            reference.index_add_(0, indices, values.double())
        grads = [p.grad.reshape(-1) for p in model.parameters()]
        results[name] = {
            "params": flat_params(model),
            "grad": torch.cat([grads[i] for i in state.bucket_layouts[key]]),  # the bucket's flat order
            "reference": reference / world,
            "stats": state.stats(),
        }
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def sparsifier_runs(request):
    return run_workers(__file__, "sparsifier_worker", request.param, timeout=240, names=sparsifier_names())


@pytest.mark.parametrize("name", sparsifier_names())
def test_sparsifier_ranks_agree_and_aggregate_matches_reference(name, sparsifier_runs):
    runs = sparsifier_runs  # one result dict per rank
    first = runs[0][name]
    for rank_result in runs[1:]:
        assert torch.equal(rank_result[name]["params"], first["params"]), f"{name}: ranks diverged"
    for rank_result in runs:
        r = rank_result[name]
        torch.testing.assert_close(r["grad"].double(), r["reference"], rtol=1e-6, atol=1e-7)
        assert 0 < r["stats"]["step"]["bytes_sent"] < r["stats"]["step"]["dense_bytes"]
    assert first["stats"]["total"]["steps"] == 4


# --- granularity, min_numel, warm-up: bytes and which tensors went dense ------------------
def granularity_worker(rank: int, world: int) -> dict:
    out = {}
    for label, options in {
        "bucket": {},
        "layer": {"granularity": "layer"},
        "layer_min": {"granularity": "layer", "min_numel": 20},
        "warmup": {"warmup_steps": 2},
        "bf16_values": {"value_dtype": "bf16"},
    }.items():
        model, state = hooked("topk", ratio=0.25, **options)
        per_step = []
        for step in range(3):
            train(model, rank, range(step, step + 1))
            per_step.append(state.stats()["step"])
        out[label] = per_step
    return out


def test_granularity_min_numel_and_warmup_change_bytes_as_documented():
    out = run_workers(__file__, "granularity_worker", 2)[0]
    dense = 4 * sum(NUMELS)
    k = [math.floor(n * 0.25) for n in NUMELS]  # 48, 4, 12, 0 -> max(1, .) = 1 for the last
    k = [max(1, v) for v in k]
    # one compress for the whole bucket: k = 64 values + 64 int32 indices + the payload's
    # 4-byte length + the message's 4-byte flag word
    bucket = out["bucket"][2]
    assert (bucket["bytes_sent"], bucket["dense_bytes"]) == (64 * 8 + 4 + 4, dense)
    assert (bucket["compressed_tensors"], bucket["dense_tensors"], bucket["elements_sent"]) == (1, 0, 64)
    # one compress per parameter: per layer its own k and its own length, one message
    layer = out["layer"][2]
    assert layer["bytes_sent"] == sum(8 * v + 4 for v in k) + 4
    assert (layer["compressed_tensors"], layer["dense_tensors"]) == (4, 0)
    # min_numel=20: the biases (16 and 3 elements) go dense in fp32, the weights compressed
    small = out["layer_min"][2]
    assert small["bytes_sent"] == (8 * k[0] + 4) + (8 * k[2] + 4) + 4 + 4 * (NUMELS[1] + NUMELS[3])
    assert (small["compressed_tensors"], small["dense_tensors"]) == (2, 2)
    assert small["elements_sent"] == k[0] + k[2] + NUMELS[1] + NUMELS[3]
    # warm-up: two dense steps (every byte, density 1), then compressed
    warm = out["warmup"]
    assert [s["bytes_sent"] for s in warm] == [dense, dense, 64 * 8 + 8]
    assert [s["density"] for s in warm[:2]] == [1.0, 1.0]
    # bf16 values: 2 bytes per value instead of 4
    assert out["bf16_values"][2]["bytes_sent"] == 64 * (2 + 4) + 8
    assert bucket["density"] == pytest.approx(64 / sum(NUMELS))
