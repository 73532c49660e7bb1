"""QSGD, TernGrad, signSGD, EF-signSGD: unbiasedness, exact codes and bytes, state, bad input."""

import math

import pytest
import torch

import gradsift
from gradsift.hook.feedback import ErrorFeedback

QUANTIZERS = ["qsgd", "terngrad", "signsgd", "efsignsgd"]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def mixed_scale_gradient(numel: int, seed: int = 1) -> torch.Tensor:
    """A float64 gradient whose magnitudes span three orders (like real layers)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    return x * torch.logspace(-2, 1, numel, dtype=torch.float64)[torch.randperm(numel, generator=gen)]


def assert_unbiased(
    compressor,
    x: torch.Tensor,
    variance: torch.Tensor,
    draws: int,
    interval: torch.Tensor,
    expected: torch.Tensor | None = None,
) -> None:
    """Mean of ``draws`` compressions of ``x`` vs ``expected`` (default ``x``), given each
    element's exact variance and its rounding ``interval`` (the distance between the two
    values it rounds to, so that ``variance = interval^2 p (1 - p)``).

    The error of the mean of element i has variance ``variance_i / draws``; its sum of
    squares has expectation ``sum(variance) / draws`` and relative spread about
    ``sqrt(2 / n_eff)`` (a few percent here), so a ratio in [0.85, 1.15] also catches a
    wrong variance. No single element may be more than 6 standard deviations off where the
    count of its rounding-ups is near normal (``draws p (1 - p) >= 10``): there the chance of
    that for a correct quantizer is below 1e-5 with 2000 elements. An element rounded up with a
    small ``p`` is not: at ``draws p = 0.09`` two round-ups (a 0.4 % chance) are 6.4 standard
    deviations, and over the thousand such elements here one outlier of that size is about
    as likely as not; those elements count in the sum of squares only.
    """
    payloads = [compressor.compress(x) for _ in range(draws)]
    mean = compressor.decompress(payloads, x.numel())
    x = x if expected is None else expected
    error = mean - x
    ratio = float(error.square().sum() / (variance.sum() / draws))
    assert 0.85 < ratio < 1.15, ratio
    exact = variance == 0
    # Zero-variance elements (zeros, the maximum, integer levels) are exact up to the
    # float64 rounding of summing ``draws`` equal terms.
    torch.testing.assert_close(mean[exact], x[exact], rtol=1e-12, atol=0)
    normal = ~exact & (draws * variance / interval.square() >= 10)
    assert int(normal.sum()) > 100  # the check below sees many elements
    z = error[normal].abs() / (variance[normal] / draws).sqrt()
    assert float(z.max()) < 6.0


def test_qsgd_is_unbiased_with_the_derived_variance():
    levels, bucket = 3, 128
    x = mixed_scale_gradient(2000)
    x[::97] = 0.0
    compressor = gradsift.get_compressor("qsgd", levels=levels, bucket_size=bucket, seed=3)
    padded = torch.cat([x, x.new_zeros(-x.numel() % bucket)]).view(-1, bucket)
    norms = padded.norm(dim=1, keepdim=True)
    ratio = (levels * padded.abs() / norms).view(-1)[: x.numel()]
    fraction = ratio - ratio.floor()
    step = (norms / levels).expand_as(padded).reshape(-1)[: x.numel()]
    assert_unbiased(compressor, x, step.square() * fraction * (1 - fraction), draws=400, interval=step)


def test_terngrad_without_clipping_is_unbiased_with_the_derived_variance():
    x = mixed_scale_gradient(2000, seed=2)
    x[::101] = 0.0
    scale = x.abs().max()
    compressor = gradsift.get_compressor("terngrad", clip=None, seed=5)
    assert_unbiased(compressor, x, x.abs() * (scale - x.abs()), draws=400, interval=scale.expand_as(x))


def test_terngrad_clipping_hand_computed():
    # 15 elements +-1 and one 7: mean(x^2) = (15 + 49) / 16 = 4, sigma = 2, so the
    # paper's c = 2.5 clips at 5: h = (+-1, ..., 5) and the scale is 5, not 7.
    x = torch.tensor([1.0, -1.0] * 7 + [1.0, 7.0])
    compressor = gradsift.get_compressor("terngrad")
    assert compressor.clip == 2.5
    expected = x.clone()
    expected[-1] = 5.0
    assert torch.equal(compressor.clipped_magnitudes(x), expected.abs())
    assert compressor.compress(x).scales.tolist() == [5.0]
    # c = 1 clips at 2; without clipping the scale stays the maximum
    assert gradsift.get_compressor("terngrad", clip=1.0).compress(x).scales.tolist() == [2.0]
    assert gradsift.get_compressor("terngrad", clip=None).compress(x).scales.tolist() == [7.0]
    # the same bound for the negated tensor (clipping is symmetric about zero)
    assert torch.equal(compressor.clipped_magnitudes(-x), expected.abs())


def test_terngrad_is_unbiased_for_the_clipped_gradient_with_less_variance():
    x = mixed_scale_gradient(2000, seed=2)
    compressor = gradsift.get_compressor("terngrad", seed=5)
    bound = 2.5 * x.square().mean().sqrt()
    clipped = x.clamp(-bound, bound)
    assert int((x.abs() > bound).sum()) > 10  # the heavy tail is cut
    scale = clipped.abs().max()
    variance = clipped.abs() * (scale - clipped.abs())
    assert_unbiased(compressor, x, variance, draws=400, interval=scale.expand_as(x), expected=clipped)
    unclipped_variance = x.abs() * (x.abs().max() - x.abs())
    assert float(variance.sum()) < 0.5 * float(unclipped_variance.sum())


def test_qsgd_exact_when_levels_hit_integers():
    # ||x|| = 5 and s = 5: r = (3, 4, 0) are integers, so rounding is exact.
    compressor = gradsift.get_compressor("qsgd", levels=5, bucket_size=None)
    x = torch.tensor([3.0, -4.0, 0.0])
    payload = compressor.compress(x)
    assert torch.equal(compressor.decompress([payload], 3), x)
    assert payload.scales.tolist() == [5.0]
    assert compressor.code_bits == 4  # codes in [0, 10]
    # packed codes + one fp32 norm; the size follows from numel, so no length travels
    assert payload.nbytes == math.ceil(3 * 4 / 8) + 4
    assert payload.variable_size is False


def test_qsgd_counts_bytes_of_codes_and_bucket_norms():
    payload = gradsift.get_compressor("qsgd").compress(torch.randn(1001))
    # levels 15 -> codes in [0, 30] -> 5 bits; 2 buckets of 512 -> 2 fp32 norms.
    assert payload.nbytes == math.ceil(1001 * 5 / 8) + 2 * 4 == 634
    assert payload.info["bits_per_element"] == pytest.approx(8 * 634 / 1001)
    assert gradsift.get_compressor("qsgd", levels=127).code_bits == 8


def test_terngrad_exact_values_and_bytes():
    compressor = gradsift.get_compressor("terngrad")
    x = torch.tensor([2.0, -2.0, 0.0, 2.0, -2.0])
    payload = compressor.compress(x)
    assert torch.equal(compressor.decompress([payload], 5), x)
    assert payload.nbytes == 2 + 4  # 10 bits -> 2 bytes, one fp32 scale


def test_signsgd_sends_signs_and_mean_magnitude():
    compressor = gradsift.get_compressor("signsgd")
    payload = compressor.compress(torch.tensor([1.0, -2.0, 0.0, 3.0]))
    assert payload.scales.tolist() == [1.5]
    assert payload.codes.tolist() == [0b0010]
    assert payload.nbytes == 1 + 4
    assert compressor.decompress([payload], 4).tolist() == [1.5, -1.5, 1.5, 1.5]
    other = compressor.compress(torch.tensor([-1.0, -1.0, -1.0, -1.0]))
    assert compressor.decompress([payload, other], 4).tolist() == [0.25, -1.25, 0.25, 0.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_scale_codes_decode_to_their_definition_at_any_length(dtype):
    """signSGD's mean of 3 workers, element by element from the definition (``+s`` for
    ``g >= 0``, ``-s`` below, ``s = ||g||_1 / n``), and TernGrad's codes (0 -> 0, 1 -> -s,
    2 -> +s): lengths that end inside a byte, payloads decoded a byte at a time."""
    for numel in (1, 7, 8, 13, 4099):
        workers = [torch.randn(numel, generator=torch.Generator().manual_seed(numel + w)) for w in range(3)]
        workers = [x.to(dtype) for x in workers]
        signs = gradsift.get_compressor("signsgd")
        mean = signs.decompress([signs.compress(x) for x in workers], numel)
        by_definition = [
            sum((1.0 if float(x[i]) >= 0 else -1.0) * float(x.double().abs().mean()) for x in workers) / 3
            for i in range(numel)
        ]
        rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[
            dtype
        ]  # the result's rounding
        torch.testing.assert_close(mean.double(), torch.tensor(by_definition, dtype=torch.float64),
                                   rtol=rtol, atol=0)  # fmt: skip
        ternary = gradsift.get_compressor("terngrad", seed=3)
        payload = ternary.compress(workers[0])
        codes = [
            (int(b) >> (2 * (i % 4))) & 3 for i, b in enumerate(payload.codes.repeat_interleave(4).tolist())
        ]
        scale = float(payload.scales[0])
        expected = [{0: 0.0, 1: -scale, 2: scale}[c] for c in codes[:numel]]
        assert ternary.decompress([payload], numel).double().tolist() == pytest.approx(expected, rel=rtol)


def test_error_feedback_flags():
    flags = {n: gradsift.get_compressor(n).error_feedback for n in QUANTIZERS}
    assert flags == {"qsgd": False, "terngrad": False, "signsgd": False, "efsignsgd": True}
    # the stochastic ones only by the allgather; the deterministic codes also by the two-stage
    # compressed allreduce, whose server codes the workers' mean again
    exchanges = {n: gradsift.get_compressor(n).exchanges for n in QUANTIZERS}
    assert exchanges == {
        "qsgd": ("allgather",), "terngrad": ("allgather",),
        "signsgd": ("allgather", "two-stage"), "efsignsgd": ("allgather", "two-stage"),
    }  # fmt: skip


def test_efsignsgd_conservation_law_over_steps():
    """``compensated == sent + residual`` per step, to float32 rounding of one subtract and add.

    ``r = fl(c - s)`` and ``fl(s + r)`` each round once, so per element
    ``|fl(s + r) - c| <= eps * (|c| + |s|)`` (eps = 2**-23). Summed over steps the
    sent tensors plus the final residual telescope to the sum of the gradients.
    """
    compressor = gradsift.get_compressor("efsignsgd")
    feedback = ErrorFeedback()
    eps = torch.finfo(torch.float32).eps
    total_sent = torch.zeros(3000, dtype=torch.float64)
    total_gradient = torch.zeros(3000, dtype=torch.float64)
    for step in range(5):
        gradient = torch.randn(3000) * (step + 1)
        compensated = feedback.compensate("w", gradient)
        payload = compressor.compress(compensated)
        sent = compressor.sent_dense(payload)
        feedback.update("w", compensated.clone(), payload, compressor)
        residual = feedback.residuals["w"]
        bound = eps * (compensated.abs() + sent.abs())
        assert bool(((sent + residual) - compensated).abs().le(bound).all())
        total_sent += sent.double()
        total_gradient += gradient.double()
    torch.testing.assert_close(total_sent + residual.double(), total_gradient, rtol=0, atol=1e-4)


def test_generator_state_round_trip_reproduces_draws():
    x = torch.randn(777)
    first = gradsift.get_compressor("qsgd", seed=11)
    first.compress(x)
    state = first.state_dict()
    expected = first.compress(x)
    resumed = gradsift.get_compressor("qsgd", seed=11)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.compress(x).codes, expected.codes)
    fresh = gradsift.get_compressor("qsgd", seed=11)
    assert torch.equal(fresh.compress(x).codes, gradsift.get_compressor("qsgd", seed=11).compress(x).codes)
    assert not torch.equal(
        fresh.compress(x).codes, gradsift.get_compressor("qsgd", seed=12).compress(x).codes
    )


def test_load_state_dict_rejects_other_seed_and_keys():
    compressor = gradsift.get_compressor("terngrad", seed=1)
    with pytest.raises(ValueError, match="seed=2"):
        compressor.load_state_dict({"seed": 2, "generators": {}})
    with pytest.raises(ValueError, match="seed, generators"):
        compressor.load_state_dict({"residuals": {}})
    assert gradsift.get_compressor("signsgd").state_dict() == {}


def test_each_key_draws_its_own_stream_and_an_older_or_broken_state_is_refused_whole():
    """A key's rounding does not depend on the keys encoded before it (DDP's bucket order),
    and a state of one generator per device (the format before) or a malformed entry is
    refused before any generator of the compressor is replaced."""
    x, y = torch.randn(300), torch.randn(200)
    alone, after = gradsift.get_compressor("terngrad", seed=1), gradsift.get_compressor("terngrad", seed=1)
    after.compress(y, key=(0, 1))  # another key first
    assert torch.equal(alone.compress(x, key=(2, 3)).codes, after.compress(x, key=(2, 3)).codes)
    saved = after.state_dict()
    with pytest.raises(ValueError, match="one rounding generator per device"):
        alone.load_state_dict({"seed": 1, "generators": {"cpu": saved["generators"][0][2]}})
    with pytest.raises(ValueError, match=r"\[device name, key, state\] entries"):
        alone.load_state_dict({"seed": 1, "generators": [*saved["generators"], ["cpu", 5]]})
    assert [k for _, k in alone.generators] == [(2, 3)]  # untouched by either refusal
    alone.load_state_dict(saved)
    assert sorted(k for _, k in alone.generators) == [(0, 1), (2, 3)]


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_any_float_dtype_and_shape_round_trips_in_its_dtype(name, dtype):
    compressor = gradsift.get_compressor(name)
    x = torch.randn(3, 5, 7).to(dtype)
    dense = compressor.decompress([compressor.compress(x), compressor.compress(x)], x.numel())
    assert dense.dtype == dtype
    assert dense.shape == (105,)
    assert bool(torch.isfinite(dense).all())
    # Every quantizer keeps the direction: positive correlation with the input.
    assert float((dense.double() * x.double().view(-1)).sum()) > 0


@pytest.mark.parametrize("name", QUANTIZERS)
def test_empty_tensor_gives_empty_payload(name):
    compressor = gradsift.get_compressor(name)
    payload = compressor.compress(torch.empty(0))
    assert payload.numel == 0 and payload.codes.numel() == 0
    assert payload.nbytes == payload.header_nbytes == 0  # a size that follows from numel
    assert compressor.decompress([payload], 0).shape == (0,)


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises(name, bad):
    x = torch.randn(2000)
    x[1234] = bad
    with pytest.raises(gradsift.NonFiniteGradientError):
        gradsift.get_compressor(name).compress(x)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_integer_tensor_is_a_type_error(name):
    with pytest.raises(TypeError, match="floating dtype"):
        gradsift.get_compressor(name).compress(torch.arange(10))


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("qsgd", {"levels": 0}, "levels must lie in"),
        ("qsgd", {"levels": 128}, "levels must lie in"),
        ("qsgd", {"levels": 2.5}, "levels must be an integer"),
        ("qsgd", {"levels": float("nan")}, "levels must be an integer"),
        ("qsgd", {"levels": True}, "levels must be an integer"),
        ("qsgd", {"bucket_size": 0}, "bucket_size must lie in"),
        ("terngrad", {"seed": -1}, "seed must lie in"),
        ("terngrad", {"clip": 0.0}, "clip must lie in"),
        ("qsgd", {"seed": "7"}, "seed must be an integer"),
        ("signsgd", {"ratio": 0.1}, "no option.*ratio"),
        ("terngrad", {"levels": 3}, "no option.*levels.*seed"),
    ],
)
def test_bad_options_name_the_argument(name, options, message):
    with pytest.raises(ValueError, match=message):
        gradsift.get_compressor(name, **options)


def test_decompress_rejects_wrong_numel_and_no_payloads():
    compressor = gradsift.get_compressor("qsgd")
    payload = compressor.compress(torch.randn(10))
    with pytest.raises(ValueError, match="expected numel=11"):
        compressor.decompress([payload], 11)
    with pytest.raises(ValueError, match="at least one payload"):
        compressor.decompress([], 10)


@pytest.mark.parametrize("missing", ["codes", "scales"])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_decompress_refuses_a_payload_without_codes_or_scales(name, missing):
    compressor = gradsift.get_compressor(name)
    payload = compressor.compress(torch.randn(10))
    setattr(payload, missing, None)
    with pytest.raises(gradsift.InvalidOptionError, match=f"a {name} payload carries codes and scales"):
        compressor.decompress([payload], 10)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_truncated_codes_are_a_wire_error(name):
    compressor = gradsift.get_compressor(name)
    payload = compressor.compress(torch.randn(100))
    payload.codes = payload.codes[:-1]
    with pytest.raises(gradsift.WireFormatError, match="code bytes"):
        compressor.decompress([payload], 100)


# --- a DDP bucket's layout: quantized in parameter-number order ---------------------------
#: Parameter sizes of a bucket whose layouts straddle QSGD's 512-element norm buckets.
BUCKET_NUMELS = {0: 700, 1: 37, 2: 300, 3: 1}


def laid_out(x_by_param: dict[int, torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([x_by_param[i] for i in order])


@pytest.mark.parametrize("name", QUANTIZERS)
def test_a_bucket_quantizes_alike_in_any_layout(name):
    """The same parameters flattened in two layouts (DDP's before and after its bucket
    rebuild) decode, worker means included, to the same bits at every parameter: the
    payloads are encoded in canonical order and laid back on decoding (QSGD's per-512
    norms would otherwise group other elements)."""
    gen = torch.Generator().manual_seed(5)
    grads = [
        {i: torch.randn(n, generator=gen, dtype=torch.float64) for i, n in BUCKET_NUMELS.items()}
        for _ in range(2)
    ]
    key = tuple(sorted(BUCKET_NUMELS))
    decoded = {}
    for order in [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)]:
        seeds = [{"seed": rank} if name in ("qsgd", "terngrad") else {} for rank in range(2)]
        workers = [gradsift.get_compressor(name, **seed) for seed in seeds]
        payloads = []
        for compressor, grad in zip(workers, grads, strict=True):
            compressor.store.follow(key, order, BUCKET_NUMELS)
            payloads.append(compressor.compress(laid_out(grad, order), key=key))
            assert (payloads[-1].canonical is None) == (order == key)  # in number order: as it is
        numel = sum(BUCKET_NUMELS.values())
        mean = workers[0].decompress(payloads, numel)
        into = torch.full((numel,), float("nan"), dtype=torch.float64)
        assert workers[0].decompress_into(payloads, into) is None
        assert torch.equal(into, mean)
        sizes = [BUCKET_NUMELS[i] for i in order]
        decoded[order] = dict(zip(order, mean.split(sizes), strict=True))
    first = decoded[(0, 1, 2, 3)]
    for other in decoded.values():
        for i in BUCKET_NUMELS:
            assert torch.equal(other[i], first[i]), (name, i)


def test_qsgd_bucket_norms_follow_the_canonical_order():
    """A rebuilt layout does not regroup QSGD's norms: the payload's scales are those of
    the parameters in number order."""
    x = {i: torch.full((n,), float(i + 1), dtype=torch.float64) for i, n in BUCKET_NUMELS.items()}
    compressor = gradsift.get_compressor("qsgd")
    key = tuple(sorted(BUCKET_NUMELS))
    compressor.store.follow(key, (3, 2, 1, 0), BUCKET_NUMELS)
    payload = compressor.compress(laid_out(x, (3, 2, 1, 0)), key=key)
    canonical = laid_out(x, key)
    padded = torch.cat([canonical, canonical.new_zeros(-canonical.numel() % 512)]).view(-1, 512)
    assert torch.equal(payload.scales, padded.norm(dim=1))


def test_payloads_in_different_orders_are_refused():
    key = tuple(sorted(BUCKET_NUMELS))
    x = mixed_scale_gradient(sum(BUCKET_NUMELS.values()))
    rebuilt, plain = gradsift.get_compressor("qsgd"), gradsift.get_compressor("qsgd")
    rebuilt.store.follow(key, (3, 2, 1, 0), BUCKET_NUMELS)
    payloads = [rebuilt.compress(x, key=key), plain.compress(x, key=key)]
    with pytest.raises(gradsift.core.errors.InvalidOptionError, match="canonical order"):
        rebuilt.decompress(payloads, x.numel())
