"""The public API: registry, payload accounting, Top-k, dense casts, error feedback."""

import pytest
import torch

import gradsift
from gradsift.compressors import Payload, scatter_mean, target_count
from gradsift.core.payload import FIELD_HEADER_NBYTES, index_dtype
from gradsift.hook.feedback import ErrorFeedback


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
        "cocktail",
        "sidco-exp",
        "sidco-gpareto",
        "sidco-gamma",
        "vgc",
        "qsgd",
        "blockquant",
        "terngrad",
        "signsgd",
        "efsignsgd",
        "onebit",
        "powersgd",
    ]


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown compressor .sidco.*topk.*sidco-exp"):
        gradsift.get_compressor("sidco")


@pytest.mark.parametrize(
    ("typed", "meant"), [("TopK", "topk"), ("sidco", "sidco-exp"), ("powerSGD", "powersgd")]
)
def test_a_near_miss_is_offered_the_name_meant(typed, meant):
    with pytest.raises(ValueError, match=f"unknown compressor '{typed}' \\(did you mean '{meant}'\\?\\)"):
        gradsift.get_compressor(typed)


def test_a_name_near_nothing_is_offered_nothing():
    with pytest.raises(ValueError) as refused:
        gradsift.get_compressor("xyz")
    assert "did you mean" not in str(refused.value)


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
    # 3 fp32 values + 3 indices at wire width (int32) + the payload's one 4-byte length.
    assert p.indices.dtype == torch.int64 and p.nbytes == 3 * 4 + 3 * 4 + 4


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


# powersgd has no compress() of a single tensor (it refuses every call, tested in test_powersgd.py)
SINGLE_TENSOR_COMPRESSORS = [name for name in gradsift.available_compressors() if name != "powersgd"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1.0, 2.0, 3.0, 4.0], "tensor must be a torch.Tensor, got list"),
        (torch.ones(4).to_sparse(), "tensor must be a dense (strided) tensor, got layout torch.sparse_coo"),
        (
            torch.ones(4, dtype=torch.int32),
            "tensor must have a floating dtype (float16, bfloat16, float32, float64), got torch.int32",
        ),
    ],
    ids=["list", "sparse", "int32"],
)
@pytest.mark.parametrize("name", SINGLE_TENSOR_COMPRESSORS)
def test_every_compressor_refuses_what_is_not_a_dense_float_tensor(name, bad, message):
    compressor = gradsift.get_compressor(name, **({"threshold": 0.001} if name == "threshold" else {}))
    extra = {"variance": torch.ones(4)} if name == "vgc" else {}
    with pytest.raises(gradsift.InvalidTensorError) as info:
        compressor.compress(bad, **extra)
    assert str(info.value) == message


def test_empty_tensor_gives_empty_payload():
    p = gradsift.get_compressor("topk").compress(torch.empty(0))
    assert p.count == 0 and p.numel == 0
    assert gradsift.get_compressor("topk").decompress([p], 0).numel() == 0


def test_scatter_mean_adds_duplicate_indices_across_workers():
    a = Payload(numel=4, dtype=torch.float32, values=torch.tensor([1.0, 2.0]), indices=torch.tensor([0, 2]))
    b = Payload(numel=4, dtype=torch.float32, values=torch.tensor([3.0, 5.0]), indices=torch.tensor([2, 3]))
    assert scatter_mean([a, b], 4).tolist() == [0.5, 0.0, 2.5, 2.5]


def test_scatter_mean_refuses_a_payload_without_indices():
    dense = Payload(numel=2, dtype=torch.float32, values=torch.ones(2), variable_size=False)
    with pytest.raises(gradsift.InvalidOptionError, match="sparse payloads: each with indices and values"):
        scatter_mean([dense], 2)


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
    assert c.exchanges == ("allreduce",) and not c.error_feedback


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_dense_decompress_refuses_a_payload_of_the_wrong_length_or_without_values(name):
    c = gradsift.get_compressor(name)
    payload = c.compress(torch.randn(5))
    with pytest.raises(gradsift.InvalidOptionError, match="payload holds 5 values, expected numel=6"):
        c.decompress([payload], 6)
    payload.values = None
    with pytest.raises(gradsift.InvalidOptionError, match="payload holds None values, expected numel=5"):
        c.decompress([payload], 5)


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


# --- the base classes' contract, each rule on a hand-made example --------------------------


def test_payload_fields_bytes_and_count_by_layout():
    values, indices = torch.tensor([1.0, 2.0], dtype=torch.float16), torch.tensor([4, 9])
    sparse = Payload(numel=10, dtype=torch.float32, values=values, indices=indices)
    assert list(sparse.fields()) == ["values", "indices"] and sparse.count == 2
    assert sparse.header_nbytes == FIELD_HEADER_NBYTES  # one length per variable-size payload
    assert sparse.nbytes == 2 * 2 + 2 * 4 + FIELD_HEADER_NBYTES  # fp16 values, int32-wide indices
    codes, scales = torch.zeros(3, dtype=torch.uint8), torch.ones(2, dtype=torch.float64)
    quantized = Payload(numel=7, dtype=torch.float32, codes=codes, scales=scales, variable_size=False)
    assert list(quantized.fields()) == ["codes", "scales"] and quantized.count == 7
    assert quantized.nbytes == 3 + 2 * 8  # its size follows from numel: no length travels
    dense = Payload(numel=5, dtype=torch.float32, values=torch.ones(5), variable_size=False)
    assert dense.header_nbytes == 0 and dense.nbytes == 20 and dense.count == 5
    long = Payload(numel=2**31, dtype=torch.float32, values=values, indices=indices)
    assert long.nbytes == 2 * 2 + 2 * 8 + FIELD_HEADER_NBYTES  # int64 positions past 2^31 - 1
    # a fixed-capacity payload: every entry travels; used_nbytes counts those in use
    padded = Payload(
        numel=10, dtype=torch.float32, values=torch.ones(4), indices=torch.arange(4), length=torch.tensor(3)
    )
    assert padded.nbytes == 4 * 4 + 4 * 4 + FIELD_HEADER_NBYTES and padded.count == 3
    assert int(padded.used_nbytes()) == 3 * 4 + 3 * 4 + FIELD_HEADER_NBYTES
    assert padded.trimmed().indices.tolist() == [0, 1, 2] and padded.trimmed().length is None


def test_index_dtype_boundary():
    assert index_dtype(0) == index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


def test_stateless_compressors_refuse_state_and_describe_themselves():
    topk = gradsift.get_compressor("topk", ratio=0.25)
    assert topk.state_dict() == {}
    topk.load_state_dict({})  # nothing to restore
    with pytest.raises(ValueError, match=r"topk keeps no state, got keys \['a', 'b'\]"):
        topk.load_state_dict({"b": 1, "a": 2})
    assert repr(topk) == "TopK(ratio=0.25)" and topk.options() == {"ratio": 0.25}
    assert repr(gradsift.get_compressor("randomk", ratio=0.5, seed=3)) == "RandomK(ratio=0.5, seed=3)"
    assert repr(gradsift.get_compressor("fp16")) == "Float16()"
    assert gradsift.get_compressor("randomk", ratio=0.5, seed=3).options() == {"ratio": 0.5, "seed": 3}
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert topk.attach(model) is None and list(model._forward_hooks) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_sparsifier_payload_dtypes_devices_and_empty_input():
    x = torch.tensor([[0.5, -3.0], [2.0, 0.1]], dtype=torch.float64)
    p = gradsift.get_compressor("topk", ratio=0.5).compress(x)
    assert p.numel == 4 and p.dtype == torch.float64 and p.variable_size
    assert p.indices.dtype == torch.int64 and p.values.dtype == torch.float64
    assert sorted(p.indices.tolist()) == [1, 2]
    empty = gradsift.get_compressor("topk").compress(torch.empty(0, dtype=torch.float16))
    assert empty.indices.dtype == torch.int64 and empty.values.dtype == torch.float16
    assert empty.nbytes == FIELD_HEADER_NBYTES


def test_scatter_mean_casts_to_the_first_payload_dtype_and_checks_numel():
    a = Payload(
        numel=3,
        dtype=torch.float64,
        values=torch.tensor([1.0], dtype=torch.float64),
        indices=torch.tensor([0]),
    )
    b = Payload(
        numel=3,
        dtype=torch.float64,
        values=torch.tensor([0.5], dtype=torch.float16),
        indices=torch.tensor([2]),
    )
    dense = scatter_mean([a, b], 3)
    assert dense.dtype == torch.float64 and dense.tolist() == [0.5, 0.0, 0.25]
    assert scatter_mean([a], 3).tolist() == [1.0, 0.0, 0.0]  # one payload: no division
    with pytest.raises(ValueError, match="payload encodes 3 elements, expected numel=4"):
        scatter_mean([a], 4)
    with pytest.raises(ValueError, match="^payloads must hold at least one payload$"):
        scatter_mean([], 3)
    topk = gradsift.get_compressor("topk", ratio=0.5)
    assert torch.equal(topk.sent_dense(a), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_sparse_payloads_and_their_mean_stay_on_the_gradient_device():
    """On the meta device (shapes, no data): every tensor a sparsifier makes follows its input."""
    topk = gradsift.get_compressor("topk", ratio=0.5)
    empty = topk.compress(torch.empty(0, device="meta"))
    assert empty.indices.device.type == empty.values.device.type == "meta"
    payload = Payload(
        numel=5,
        dtype=torch.float32,
        values=torch.ones(2, device="meta"),
        indices=torch.zeros(2, device="meta").long(),
    )
    assert scatter_mean([payload], 5).device.type == "meta"


def test_the_default_key_is_0():
    randomk = gradsift.get_compressor("randomk", ratio=0.5)
    randomk.compress(torch.randn(10))
    assert randomk.state_dict() == {"steps": {0: 1}}


def test_register_compressor_names_a_class_and_refuses_a_taken_name(monkeypatch):
    from gradsift.compressors import registry

    monkeypatch.setattr(registry, "_TABLE", dict(registry._TABLE))

    from gradsift.compressors.casts import Float16

    class Halves(Float16):
        """fp16 under another name, defined where no module path reaches it."""

    gradsift.register_compressor("halves", Halves)
    assert "halves" in gradsift.available_compressors()
    assert type(gradsift.get_compressor("halves")) is Halves
    with pytest.raises(gradsift.InvalidOptionError, match="'topk' is taken"):
        gradsift.register_compressor("topk", Halves)
    with pytest.raises(gradsift.InvalidOptionError, match="'auto' is taken"):
        gradsift.register_compressor("auto", Halves)
    with pytest.raises(gradsift.InvalidOptionError, match="Compressor subclass"):
        gradsift.register_compressor("nothing", int)


def test_every_public_name_imports_and_dir_shows_only_them():
    """Each name of ``gradsift.__all__`` resolves (the lazy ones on first access), and ``dir()``
    -- what completion offers -- lists those and the ``compressors`` subpackage, not the
    module's own imports."""
    for name in gradsift.__all__:
        assert getattr(gradsift, name) is not None, name
    assert dir(gradsift) == sorted({*gradsift.__all__, "compressors"})
    assert not {"Any", "cast", "importlib", "TYPE_CHECKING"} & set(dir(gradsift))
