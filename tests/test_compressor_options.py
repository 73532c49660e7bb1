"""Every option of the baselines and quantizers, checked against a reference computed in the test.

Each reference is the documented rule written out plainly (sort, loop, dense arithmetic)
and compared with what the compressor sends; an option that stopped doing what its
docstring says would change the selected set, the codes or the bytes.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

import gradsift
from gradsift.bitpack import bits_for, unpack


def laplace(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(n, dtype=torch.float64).exponential_(generator=generator)
    return (x * (torch.randint(0, 2, (n,), generator=generator) * 2 - 1)).to(dtype)


def selected(payload) -> set[int]:
    return set(payload.indices.tolist())


def top_set(magnitudes: torch.Tensor, k: int) -> set[int]:
    """Positions of the ``k`` largest magnitudes, by a full sort."""
    return set(torch.sort(magnitudes, descending=True, stable=True).indices[:k].tolist())


def expected_count(n: int, ratio: float) -> int:
    return max(1, math.floor(n * ratio))


# --- ratio: exact counts ------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1e-6, 0.003, 0.01, 0.3333, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_topk_sends_the_k_largest_by_a_full_sort(ratio, dtype):
    x = laplace(2999, seed=1, dtype=dtype)  # n * ratio = 29.99 at 0.01: floor, not round
    payload = gradsift.get_compressor("topk", ratio=ratio).compress(x)
    k = expected_count(2999, ratio)
    assert payload.count == k
    # With ties (fp16) any of the tied elements may be sent: compare the sent magnitudes.
    sent = torch.sort(x.abs()[payload.indices], descending=True).values
    assert torch.equal(sent, torch.sort(x.abs(), descending=True).values[:k])
    assert torch.equal(payload.values, x[payload.indices])


@pytest.mark.parametrize("ratio", [1e-6, 0.003, 0.25, 0.75, 1.0])
def test_randomk_sends_k_distinct_unscaled_values(ratio):
    x = laplace(1999, seed=2)
    payload = gradsift.get_compressor("randomk", ratio=ratio).compress(x)
    assert payload.count == payload.indices.unique().numel() == expected_count(1999, ratio)
    assert torch.equal(payload.values, x[payload.indices])  # not rescaled by n/k


def test_randomk_seed_selects_the_stream():
    x = laplace(10_000, seed=3)
    draws = {
        seed: [
            gradsift.get_compressor("randomk", ratio=0.01, seed=seed).compress(x).indices for _ in range(2)
        ]
        for seed in (0, 1, 2)
    }
    # a fresh instance with the same seed repeats the first call; different seeds differ
    again = gradsift.get_compressor("randomk", ratio=0.01, seed=1).compress(x).indices
    assert torch.equal(again, draws[1][0])
    firsts = [set(d[0].tolist()) for d in draws.values()]
    assert all(len(a & b) < 20 for i, a in enumerate(firsts) for b in firsts[i + 1 :])  # ~1 in common


# --- dgc: sample_ratio, min_sample, seed ----------------------------------------------------


def dgc_reference(x: torch.Tensor, ratio: float, sample_ratio: float, min_sample: int, generator) -> set[int]:
    """DGC's documented selection, step by step, drawing from ``generator`` as the instance does."""
    a = x.abs()
    n = a.numel()
    k = expected_count(n, ratio)
    size = min(n, max(min_sample, math.ceil(n * sample_ratio)))
    positions = torch.randint(n, (size,), generator=generator)
    eta = float(torch.sort(a[positions], descending=True).values[math.ceil(size * ratio) - 1])
    chosen = [i for i in range(n) if a[i] >= eta]  # ties at eta included
    if len(chosen) > 4 / 3 * k:
        return set(sorted(chosen, key=lambda i: -float(a[i]))[:k])
    return set(chosen)


@pytest.mark.parametrize(
    ("sample_ratio", "min_sample", "seed"),
    [
        (0.01, 1024, 0),  # the defaults: 1024 of 4001 sampled
        (0.01, 1, 0),  # ceil(4001 * 0.01) = 41 sampled
        (0.01, 1, 5),
        (0.5, 1, 3),  # 2001 sampled
        (1.0, 1, 4),  # n sampled (with replacement)
        (1e-4, 1, 1),  # one element sampled: trimmed to k, or few sent
        (1e-4, 1, 2),
        (1e-4, 10_000, 6),  # min_sample above n: n sampled
    ],
)
def test_dgc_sample_options_match_the_documented_selection(sample_ratio, min_sample, seed):
    """The instance's generator starts at ``seed`` and advances call by call."""
    x = laplace(4001, seed=10 + seed)
    compressor = gradsift.get_compressor(
        "dgc", ratio=0.02, sample_ratio=sample_ratio, min_sample=min_sample, seed=seed
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        payload = compressor.compress(x)
        assert selected(payload) == dgc_reference(x, 0.02, sample_ratio, min_sample, generator)


def test_dgc_fallback_and_trim_bound_the_count():
    """Over many one-element samples both branches run: every count lies in [k/2, 4/3 k]."""
    x = laplace(4000, seed=20)
    k = 80
    counts = set()
    for seed in range(30):
        payload = gradsift.get_compressor(
            "dgc", ratio=0.02, sample_ratio=1e-4, min_sample=1, seed=seed
        ).compress(x)
        assert selected(payload) == dgc_reference(x, 0.02, 1e-4, 1, torch.Generator().manual_seed(seed))
        counts.add(payload.count)
    assert k in counts and all(k / 2 <= c <= 4 / 3 * k for c in counts)


# --- redsync: iterations --------------------------------------------------------------------


def redsync_reference(x: torch.Tensor, ratio: float, iterations: int) -> set[int]:
    """The documented bisection of ``r`` in ``eta(r) = mean + r (max - mean)``, in float64 Python."""
    a = [abs(v) for v in x.double().tolist()]
    n = len(a)
    k = expected_count(n, ratio)
    mean, top = float(x.abs().mean()), float(x.abs().max())  # the compressor's dtype for the two scalars
    lo, hi, hit = 0.0, 1.0, None
    for _ in range(iterations):
        r = (lo + hi) / 2
        above = {i for i in range(n) if a[i] > mean + r * (top - mean)}
        if len(above) < k:
            hi = r
        else:
            lo, hit = r, above
            if len(above) <= 2 * k:
                break
    if hit is None:
        hit = {i for i in range(n) if a[i] > mean}
    return hit or (top_set(x.abs(), k) if top > 0 else set())


@pytest.mark.parametrize("iterations", [1, 2, 3, 5, 10, 64])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_redsync_iterations_follow_the_bisection(iterations, ratio):
    x = laplace(3000, seed=30)
    payload = gradsift.get_compressor("redsync", ratio=ratio, iterations=iterations).compress(x)
    assert selected(payload) == redsync_reference(x, ratio, iterations)


def test_redsync_stops_at_exactly_twice_k():
    # 90 zeros and 11..20: mean 1.55, max 20, k = 5. r = 1/2: eta = 10.775 selects 10 = 2k,
    # inside the bracket [k, 2k]: stop there (going on to r = 3/4 would select 16..20).
    x = torch.cat([torch.zeros(90), torch.arange(11.0, 21.0)])
    assert selected(gradsift.get_compressor("redsync", ratio=0.05).compress(x)) == set(range(90, 100))


def test_redsync_without_enough_above_any_r_sends_strictly_above_the_mean():
    # 1..5, k = 4: every r selects fewer than 4, so {x > mean = 3} = {4, 5} is sent, not 3.
    payload = gradsift.get_compressor("redsync", ratio=0.9).compress(torch.arange(1.0, 6.0))
    assert selected(payload) == {3, 4}


def test_redsync_more_iterations_reach_the_bracket():
    x = laplace(3000, seed=31)
    k = 3
    counts = [
        gradsift.get_compressor("redsync", ratio=0.001, iterations=i).compress(x).count for i in (1, 20)
    ]
    assert counts[0] > 2 * k and k <= counts[1] <= 2 * k


# --- gaussiank ------------------------------------------------------------------------------


def gaussiank_reference(x: torch.Tensor, ratio: float) -> set[int]:
    """``eta = |mu| + sigma Phi^-1(1 - ratio/2)``, up to three corrections (x0.5 / x1.5); the
    elements at a non-zero maximum magnitude always join (so a selection is never empty)."""
    a = x.abs()
    k = expected_count(x.numel(), ratio)
    mean, std = float(x.mean()), float(x.std(correction=0))
    eta = abs(mean) + std * NormalDist().inv_cdf(1 - ratio / 2)
    for correction in range(4):
        count = int((a > eta).sum())
        if correction == 3 or 2 / 3 * k <= count <= 4 / 3 * k:
            break
        eta *= 0.5 if count < 2 / 3 * k else 1.5
    chosen = set(torch.nonzero(a > eta).view(-1).tolist())
    top = float(a.max())
    return chosen | (set(torch.nonzero(a == top).view(-1).tolist()) if top > 0 else set())


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.05, 0.3])
@pytest.mark.parametrize(
    "shape", ["normal", "shifted", "laplace", "sparse"], ids=["normal", "shifted", "laplace", "sparse"]
)
def test_gaussiank_threshold_and_corrections(ratio, shape):
    generator = torch.Generator().manual_seed(40)
    x = {
        "normal": lambda: torch.randn(5000, generator=generator),
        "shifted": lambda: torch.randn(5000, generator=generator) - 0.7,  # bulk negative: |mu| matters
        "laplace": lambda: laplace(5000, seed=41),  # heavier tails: corrections run
        "sparse": lambda: (
            torch.randn(5000, generator=generator) * (torch.rand(5000, generator=generator) < 0.05)
        ),
    }[shape]()
    payload = gradsift.get_compressor("gaussiank", ratio=ratio).compress(x)
    assert selected(payload) == gaussiank_reference(x, ratio)


# --- threshold ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eta", [1e-3, 0.5, 1.0001, 2.0])
def test_threshold_compares_in_the_gradient_dtype(dtype, eta):
    x = laplace(4000, seed=50, dtype=dtype)
    x[:3] = torch.tensor([eta, -eta, 1.0009765625], dtype=torch.float64).to(
        dtype
    )  # at eta, and fp16's 1 + 2^-10
    payload = gradsift.get_compressor("threshold", threshold=eta).compress(x)
    reference = torch.nonzero(x.abs() > torch.tensor(eta, dtype=dtype)).view(-1)
    assert torch.equal(payload.indices, reference)
    assert 0 not in selected(payload) and 1 not in selected(payload)  # |x| == eta (rounded) stays
    if dtype == torch.float16 and eta == 1.0001:  # 1.0001 rounds to 1.0 in fp16: 1 + 2^-10 is above it
        assert 2 in selected(payload)


# --- qsgd: levels, bucket_size, seed --------------------------------------------------------


def qsgd_buckets(x: torch.Tensor, bucket_size: int | None) -> torch.Tensor:
    d = bucket_size or x.numel()
    return torch.cat([x, x.new_zeros(-x.numel() % d)]).view(-1, d)


@pytest.mark.parametrize("levels", [1, 2, 3, 7, 15, 127])
@pytest.mark.parametrize("bucket_size", [None, 1, 7, 512, 5000])
def test_qsgd_levels_and_buckets_round_to_a_neighbouring_level(levels, bucket_size):
    x = laplace(1999, seed=60).double() * torch.logspace(-3, 0, 1999, dtype=torch.float64)
    compressor = gradsift.get_compressor("qsgd", levels=levels, bucket_size=bucket_size, seed=levels)
    payload = compressor.compress(x)
    buckets = qsgd_buckets(x, bucket_size)
    norms = buckets.norm(dim=1)
    torch.testing.assert_close(payload.scales, norms, rtol=1e-14, atol=0)
    bits = bits_for(2 * levels)
    assert compressor.code_bits == bits
    assert payload.nbytes == math.ceil(1999 * bits / 8) + 8 * norms.numel()  # no length: fixed size
    codes = unpack(payload.codes, bits, 1999)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2 * levels
    # decoded = sign(x) * (floor(r) or floor(r) + 1) * norm / s with r = s |x| / norm
    ratio = (levels * buckets.abs() / norms.unsqueeze(1)).view(-1)[:1999]
    step = (norms / levels).repeat_interleave(buckets.shape[1])[:1999]
    level = (codes - levels).double() * torch.sign(x)
    assert bool(((level == ratio.floor()) | (level == ratio.floor() + 1)).all())
    assert bool((level[x == 0] == 0).all())
    torch.testing.assert_close(compressor.decompress([payload], 1999), (codes - levels).double() * step)


def test_qsgd_seed_fixes_the_rounding():
    x = laplace(3000, seed=61)
    zero, again, one = (
        gradsift.get_compressor("qsgd", levels=3, seed=s).compress(x).codes for s in (0, 0, 1)
    )
    assert torch.equal(zero, again) and not torch.equal(zero, one)


# --- terngrad: clip, seed ------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 1.0, 2.5, 100.0])
def test_terngrad_clips_then_sends_signed_scale_or_zero(clip):
    x = laplace(4000, seed=70)
    x[7] = 40.0  # an outlier that clipping cuts
    compressor = gradsift.get_compressor("terngrad", clip=clip, seed=3)
    payload = compressor.compress(x)
    # h = sign(x) min(|x|, c sqrt(mean x^2)); the scale is max |h|
    bound = math.inf if clip is None else clip * float(x.double().square().mean().sqrt())
    h = x.double().clamp(-bound, bound)
    scale = float(h.abs().max())
    assert payload.scales.item() == pytest.approx(scale, rel=1e-6)
    dense = compressor.decompress([payload], 4000).double()
    kept = dense != 0
    torch.testing.assert_close(dense[kept], torch.sign(x[kept]).double() * scale, rtol=1e-6, atol=0)
    assert bool(kept[h.abs() >= scale * (1 - 1e-6)].all())  # probability 1 at the (clipped) maximum
    # each kept with probability |h|/s: the count is a sum of Bernoulli draws
    p = h.abs() / scale
    mean, spread = float(p.sum()), float((p * (1 - p)).sum().sqrt())
    assert abs(int(kept.sum()) - mean) <= 4.5 * spread, (int(kept.sum()), mean)


def test_terngrad_seed_fixes_the_rounding():
    x = laplace(4000, seed=71)
    three, again, four = (gradsift.get_compressor("terngrad", seed=s).compress(x).codes for s in (3, 3, 4))
    assert torch.equal(three, again) and not torch.equal(three, four)


# --- signsgd / efsignsgd --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sign_methods_send_signs_and_mean_magnitude(name, dtype):
    x = laplace(1001, seed=80, dtype=dtype)
    x[5] = 0.0  # sign(0) = +1
    compressor = gradsift.get_compressor(name)
    payload = compressor.compress(x)
    wide = x.to(torch.promote_types(dtype, torch.float32))
    scale = wide.abs().sum() / 1001
    torch.testing.assert_close(payload.scales, scale.reshape(1), rtol=1e-6, atol=0)
    signs = torch.where(x < 0, -1.0, 1.0).to(wide.dtype)
    assert torch.equal(unpack(payload.codes, 1, 1001), (x < 0).long())
    assert payload.nbytes == math.ceil(1001 / 8) + wide.element_size()  # no length: a fixed size
    torch.testing.assert_close(compressor.decompress([payload], 1001), (signs * scale).to(dtype))


# --- dense casts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "wire"), [("none", None), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_casts_round_once_and_average_in_the_gradient_dtype(name, wire, dtype):
    xs = [laplace(1000, seed=90 + w, dtype=dtype) * 1e-3 for w in range(3)]
    compressor = gradsift.get_compressor(name)
    payloads = [compressor.compress(x) for x in xs]
    for x, payload in zip(xs, payloads, strict=True):
        assert torch.equal(payload.values, x if wire is None else x.to(wire))
        assert payload.nbytes == 1000 * (wire or dtype).itemsize and not payload.variable_size
    mean = compressor.decompress(payloads, 1000)
    assert mean.dtype == dtype
    reference = sum(p.values.to(dtype) for p in payloads) / 3
    assert torch.equal(mean, reference)
