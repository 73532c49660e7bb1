"""The public API: registry, payload accounting, Top-k, dense casts, error feedback."""

import pytest
import torch

import gradsift
from gradsift.compressors import Payload, scatter_mean, target_count
from gradsift.feedback import ErrorFeedback


def test_available_compressors_lists_every_design_name():
    assert gradsift.available_compressors() == [
        "none",
        "fp16",
        "bf16",
        "topk",
        "randomk",
        "dgc",
        "redsync",
        "gaussiank",
        "threshold",
        "sidco-exp",
        "sidco-gpareto",
        "sidco-gamma",
        "vgc",
        "qsgd",
        "terngrad",
        "signsgd",
        "efsignsgd",
        "powersgd",
    ]


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown compressor .sidco.*topk.*sidco-exp"):
        gradsift.get_compressor("sidco")


def test_unknown_option_lists_accepted_options():
    with pytest.raises(ValueError, match="no option.*bogus.*ratio"):
        gradsift.get_compressor("topk", bogus=1)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1", True])
def test_topk_rejects_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        gradsift.get_compressor("topk", ratio=ratio)


def test_target_count():
    assert target_count(0, 0.5) == 0
    assert target_count(10, 0.01) == 1
    assert target_count(1000, 0.01) == 10
    assert target_count(999, 0.01) == 9


def test_topk_selects_largest_magnitudes_and_counts_bytes():
    x = torch.tensor([0.1, -5.0, 2.0, 0.0, -0.5, 4.0, 0.3, 1.0, -3.0, 0.2])
    p = gradsift.get_compressor("topk", ratio=0.3).compress(x.reshape(2, 5))
    assert sorted(p.indices.tolist()) == [1, 5, 8]
    assert torch.equal(p.values, x[p.indices])
    # 3 fp32 values + 3 indices at wire width (int32) + one 4-byte length per field.
    assert p.indices.dtype == torch.int64 and p.nbytes == 3 * 4 + 3 * 4 + 2 * 4


def test_topk_nonfinite_raises_documented_error():
    c = gradsift.get_compressor("topk", ratio=0.1)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1000)
        x[17] = bad
        with pytest.raises(gradsift.NonFiniteGradientError):
            c.compress(x)


def test_integer_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="floating dtype"):
        gradsift.get_compressor("topk").compress(torch.arange(10))


def test_empty_tensor_gives_empty_payload():
    p = gradsift.get_compressor("topk").compress(torch.empty(0))
    assert p.count == 0 and p.numel == 0
    assert gradsift.get_compressor("topk").decompress([p], 0).numel() == 0


def test_scatter_mean_adds_duplicate_indices_across_workers():
    a = Payload(numel=4, dtype=torch.float32, values=torch.tensor([1.0, 2.0]), indices=torch.tensor([0, 2]))
    b = Payload(numel=4, dtype=torch.float32, values=torch.tensor([3.0, 5.0]), indices=torch.tensor([2, 3]))
    assert scatter_mean([a, b], 4).tolist() == [0.5, 0.0, 2.5, 2.5]


@pytest.mark.parametrize(
    "name,wire", [("none", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_dense_casts_average_and_count_bytes(name, wire):
    c = gradsift.get_compressor(name)
    xs = [torch.randn(100) for _ in range(3)]
    ps = [c.compress(x) for x in xs]
    assert all(p.values.dtype == wire and p.nbytes == 100 * wire.itemsize for p in ps)
    expected = sum(x.to(wire).float() for x in xs) / 3
    torch.testing.assert_close(c.decompress(ps, 100), expected)
    assert c.allreduce_compatible and not c.error_feedback


def test_error_feedback_conservation_is_bit_exact():
    torch.manual_seed(3)
    c = gradsift.get_compressor("topk", ratio=0.05)
    fb = ErrorFeedback()
    for _ in range(5):
        g = torch.randn(1000)
        compensated = fb.compensate("w", g)
        before = compensated.clone()
        p = c.compress(compensated)
        sent = c.sent_dense(p)
        fb.update("w", compensated, p, c)
        assert torch.equal(sent + fb.residuals["w"], before)


def test_error_feedback_dgc_momentum_correction():
    fb = ErrorFeedback(momentum=0.5)
    c = gradsift.get_compressor("topk", ratio=0.5)
    g = torch.tensor([1.0, 0.1])
    comp = fb.compensate(0, g)  # u = g, c = u
    assert comp.tolist() == [1.0, pytest.approx(0.1)]
    fb.update(0, comp, c.compress(comp), c)
    comp = fb.compensate(0, g)  # u = [0 (masked), 0.15]; r = [0, 0.1]
    assert comp.tolist() == [1.0, pytest.approx(0.25)]
    assert fb.velocities[0].tolist() == [1.0, pytest.approx(0.15)]


def test_error_feedback_state_round_trip():
    fb = ErrorFeedback(momentum=0.9)
    c = gradsift.get_compressor("topk", ratio=0.1)
    comp = fb.compensate("a", torch.randn(50))
    fb.update("a", comp, c.compress(comp), c)
    other = ErrorFeedback(momentum=0.9)
    other.load_state_dict(fb.state_dict())
    assert torch.equal(other.residuals["a"], fb.residuals["a"]) and other.residuals["a"].abs().sum() > 0
    assert torch.equal(other.velocities["a"], fb.velocities["a"])
    g = torch.randn(50)
    assert torch.equal(other.compensate("a", g), fb.compensate("a", g))
    with pytest.raises(ValueError, match="momentum"):
        ErrorFeedback(momentum=0.0).load_state_dict(fb.state_dict())
