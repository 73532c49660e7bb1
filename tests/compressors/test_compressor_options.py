"""Every option of the baselines and quantizers, checked against a reference computed in the test.

Each reference is the method's documented rule computed independently (NumPy float64,
brute force over every element, a sort instead of the implementation's comparisons) and
compared with what the compressor sends; DGC's random sample is tested through what does
not depend on the random stream. An option that stopped doing what its docstring says
would change the selected set, the codes or the bytes.
"""

from __future__ import annotations

import math
from functools import partial
from statistics import NormalDist

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

import gradsift
from gradsift.compressors.bitpack import bits_for, unpack
from support import models

#: Laplace samples (exponentials with random signs): ``laplace(n, seed, dtype=torch.float32)``.
laplace = partial(models.laplace, by="signed_exponential")


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
# DGC's sample is drawn from the instance's generator, so the oracles test what does not
# depend on the random stream: each selection is one of the method's two outcomes
# (brute force over every element in NumPy), and over many seeds the counts follow the
# distribution the sample size implies.

DGC_N, DGC_RATIO = 4001, 0.02
DGC_K = expected_count(DGC_N, DGC_RATIO)  # 80


def magnitudes(x: torch.Tensor) -> np.ndarray:
    return np.abs(x.double().numpy())


def dgc_outcome(a: np.ndarray, indices: torch.Tensor, k: int) -> str:
    """Which of DGC's outcomes ``indices`` is, asserting it is one: ``"top-k"``, the ``k``
    largest magnitudes (an over-selection cut, or a threshold that selected exactly ``k``);
    or ``"threshold"``, the set ``{|g| >= eta}`` for ``eta`` its smallest magnitude, of at
    most ``4/3 k`` elements."""
    chosen = np.sort(indices.numpy())
    assert len(chosen) > 0 and len(np.unique(chosen)) == len(chosen)
    if len(chosen) == k and np.array_equal(np.sort(a[chosen]), np.sort(a)[-k:]):
        return "top-k"
    assert len(chosen) <= 4 / 3 * k, f"{len(chosen)} entries, more than 4/3 k and not the k largest"
    assert np.array_equal(chosen, np.nonzero(a >= a[chosen].min())[0]), "not every element at or above eta"
    return "threshold"


def at_most_probability(j: int, n: int, size: int, ratio: float) -> float:
    """P(count <= j) for DGC on ``n`` distinct magnitudes: ``eta`` is the ``m``-th largest of
    ``size`` uniform draws with replacement (``m = ceil(size ratio)``), so at most ``j``
    elements reach it exactly when at least ``m`` draws fall among the ``j`` largest:
    ``P(Binomial(size, j/n) >= m)``."""
    return float(scipy_stats.binom.sf(math.ceil(size * ratio) - 1, size, j / n))


DGC_SAMPLES = [  # (sample_ratio, min_sample): s = min(n, max(min_sample, ceil(n sample_ratio)))
    (0.01, 1024),  # the defaults: s = 1024, m = 21
    (0.01, 1),  # s = 41, m = 1
    (0.5, 1),  # s = 2001, m = 41
    (1.0, 1),  # s = n (with replacement), m = 81
    (1e-4, 1),  # s = 1: eta is one random magnitude
    (1e-4, 10_000),  # min_sample above n: s = n
]


@pytest.mark.parametrize(("sample_ratio", "min_sample"), DGC_SAMPLES)
def test_dgc_selects_a_threshold_set_or_the_k_largest(sample_ratio, min_sample):
    x = laplace(DGC_N, seed=10)
    compressor = gradsift.get_compressor(
        "dgc", ratio=DGC_RATIO, sample_ratio=sample_ratio, min_sample=min_sample, seed=3
    )
    for _ in range(3):
        dgc_outcome(magnitudes(x), compressor.compress(x).indices, DGC_K)


#: Seeds per sample size in the distribution test; the empirical P(count <= j) then has a
#: standard deviation of at most 0.029.
DGC_SEEDS = 300


@pytest.mark.parametrize(("sample_ratio", "min_sample"), DGC_SAMPLES)
def test_dgc_counts_follow_the_sample_size(sample_ratio, min_sample):
    """Over 300 seeds the share of counts at most ``j`` (``j`` = 40, 60, 70, 79: below ``k``,
    where the cut to ``k`` hides nothing) matches :func:`at_most_probability` for the
    documented sample size, within 4 standard deviations plus 0.01. Measured: at most 2.0
    standard deviations off over the 24 checks. The same counts reject the other sample
    sizes' distributions (by 1.5-34 times the tolerance), except 2001 against 4001 or
    1024 (0.8-0.9 times): those three are told apart by the spread of 300 counts only."""
    x = laplace(DGC_N, seed=11)
    a = magnitudes(x)
    assert len(np.unique(a)) == DGC_N  # distinct magnitudes, as the formula assumes
    size = min(DGC_N, max(min_sample, math.ceil(DGC_N * sample_ratio)))
    counts = []
    for seed in range(DGC_SEEDS):
        compressor = gradsift.get_compressor(
            "dgc", ratio=DGC_RATIO, sample_ratio=sample_ratio, min_sample=min_sample, seed=seed
        )
        indices = compressor.compress(x).indices
        counts.append(len(indices) if dgc_outcome(a, indices, DGC_K) == "threshold" else DGC_N + 1)
    for j in (DGC_K // 2, 60, 70, DGC_K - 1):
        expected = at_most_probability(j, DGC_N, size, DGC_RATIO)
        observed = sum(c <= j for c in counts) / DGC_SEEDS
        spread = math.sqrt(expected * (1 - expected) / DGC_SEEDS)
        assert abs(observed - expected) <= 4 * spread + 0.01, (j, observed, expected, spread)


def test_dgc_cuts_over_selections_and_sends_short_ones_as_they_are():
    """A 41-element sample puts eta anywhere: both outcomes occur, and a short selection
    (fewer than k) is sent uncut -- no top-k fallback (``compress()`` is the paper's)."""
    x = laplace(DGC_N, seed=12)
    outcomes, counts = set(), set()
    for seed in range(30):
        indices = (
            gradsift.get_compressor("dgc", ratio=DGC_RATIO, sample_ratio=0.01, min_sample=1, seed=seed)
            .compress(x)
            .indices
        )
        outcomes.add(dgc_outcome(magnitudes(x), indices, DGC_K))
        counts.add(len(indices))
    assert outcomes == {"threshold", "top-k"} and min(counts) < DGC_K


def test_dgc_seed_fixes_the_sample_stream():
    """A fresh instance with the same seed repeats the selections call by call; another seed
    samples differently."""
    x = laplace(DGC_N, seed=13)

    def selections(seed: int) -> list[list[int]]:
        compressor = gradsift.get_compressor(
            "dgc", ratio=DGC_RATIO, sample_ratio=0.01, min_sample=1, seed=seed
        )
        return [compressor.compress(x).indices.tolist() for _ in range(4)]

    assert selections(7) == selections(7)
    assert selections(7) != selections(8)
    assert len({tuple(s) for s in selections(7)}) > 1  # the stream advances between calls


# --- redsync: iterations --------------------------------------------------------------------


def count_above(sorted_magnitudes: np.ndarray, threshold: float) -> int:
    """``#{a > threshold}`` by binary search in the sorted magnitudes."""
    return len(sorted_magnitudes) - int(np.searchsorted(sorted_magnitudes, threshold, side="right"))


def redsync_oracle(x: torch.Tensor, ratio: float, iterations: int) -> tuple[set[int], float]:
    """RedSync's definition in NumPy float64 (docs/baselines.md): bisect ``r`` in
    ``eta(r) = mean + r (max - mean)`` of ``a = |g|`` for at most ``iterations`` steps -- a
    count below ``k`` lowers ``hi``, above ``2k`` raises ``lo``, one in ``[k, 2k]`` stops --
    and send ``a > eta(lo)``, with the elements at a non-zero maximum. Returns the set and
    the final ``r``."""
    a = magnitudes(x)
    ordered = np.sort(a)
    k = expected_count(len(a), ratio)
    mean, top = a.mean(), a.max()
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        r = (lo + hi) / 2
        count = count_above(ordered, mean + r * (top - mean))
        if count < k:
            hi = r
        else:
            lo = r
            if count <= 2 * k:
                break
    chosen = set(np.nonzero(a > mean + lo * (top - mean))[0].tolist())
    return chosen | (set(np.nonzero(a == top)[0].tolist()) if top > 0 else set()), lo


@pytest.mark.parametrize("iterations", [1, 2, 3, 5, 10, 64])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_redsync_iterations_follow_the_bisection(iterations, ratio):
    x = laplace(3000, seed=30)
    chosen, r = redsync_oracle(x, ratio, iterations)
    assert (
        selected(gradsift.get_compressor("redsync", ratio=ratio, iterations=iterations).compress(x)) == chosen
    )
    assert (r * 2**iterations).is_integer()  # a threshold reachable in that many halvings


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_redsync_with_enough_iterations_lands_in_the_bracket(ratio):
    """With 64 steps the search reaches a count in ``[k, 2k]`` whenever more than ``k``
    elements lie above the mean (here always)."""
    x = laplace(3000, seed=32)
    k = expected_count(3000, ratio)
    assert count_above(np.sort(magnitudes(x)), float(magnitudes(x).mean())) > k
    assert k <= gradsift.get_compressor("redsync", ratio=ratio, iterations=64).compress(x).count <= 2 * k


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


def gaussiank_oracle(x: torch.Tensor, ratio: float) -> set[int]:
    """GaussianK's definition in NumPy float64 (docs/baselines.md): ``eta = |mu| + sigma
    Phi^-1(1 - ratio/2)`` with the population mean and deviation of the signed values; up
    to 3 corrections (a count below ``2/3 k`` halves ``eta``, above ``4/3 k`` multiplies it
    by 1.5), then up to 7 more halvings while the count is below ``2/3 k``; send ``a > eta``,
    with the elements at a non-zero maximum."""
    g = x.double().numpy()
    a = np.abs(g)
    ordered = np.sort(a)
    k = expected_count(len(a), ratio)
    eta = abs(g.mean()) + g.std() * NormalDist().inv_cdf(1 - ratio / 2)
    for _ in range(3):
        count = count_above(ordered, eta)
        if 2 / 3 * k <= count <= 4 / 3 * k:
            break
        eta *= 0.5 if count < 2 / 3 * k else 1.5
    for _ in range(7):
        if count_above(ordered, eta) >= 2 / 3 * k:
            break
        eta *= 0.5
    top = a.max()
    chosen = set(np.nonzero(a > eta)[0].tolist())
    return chosen | (set(np.nonzero(a == top)[0].tolist()) if top > 0 else set())


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
    assert selected(payload) == gaussiank_oracle(x, ratio)


def test_gaussiank_on_a_hand_example():
    """``g = (-3, -1, 1, 3)``: mean 0, population deviation sqrt(5); ratio 0.5 (k = 2):
    ``eta = sqrt(5) Phi^-1(0.75) = 1.508``, which 2 elements exceed (in [4/3, 8/3]): send
    the two 3s. With ratio 0.25 (k = 1) the same eta's 2 > 4/3 multiplies it by 1.5 to
    2.262: still the two 3s (the count cannot go below the ties at the max)."""
    x = torch.tensor([-3.0, -1.0, 1.0, 3.0])
    assert math.sqrt(5) * NormalDist().inv_cdf(0.75) == pytest.approx(1.508, abs=1e-3)
    for ratio in (0.5, 0.25):
        assert selected(gradsift.get_compressor("gaussiank", ratio=ratio).compress(x)) == {0, 3}


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
    codes = unpack(payload.codes, bits, 1999).long()
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


# --- signsgd / efsignsgd / onebit -----------------------------------------------------------


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "onebit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sign_methods_send_signs_and_one_scale(name, dtype):
    """The mean magnitude ``||x||_1 / n`` (signSGD's), or the root mean square
    ``||x||_2 / sqrt(n)`` (1-bit Adam's ``onebit``)."""
    x = laplace(1001, seed=80, dtype=dtype)
    x[5] = 0.0  # sign(0) = +1
    compressor = gradsift.get_compressor(name)
    payload = compressor.compress(x)
    wide = x.to(torch.promote_types(dtype, torch.float32))
    scale = wide.square().sum().sqrt() / math.sqrt(1001) if name == "onebit" else wide.abs().sum() / 1001
    torch.testing.assert_close(payload.scales, scale.reshape(1), rtol=1e-6, atol=0)
    signs = torch.where(x < 0, -1.0, 1.0).to(wide.dtype)
    assert torch.equal(unpack(payload.codes, 1, 1001), (x < 0).to(torch.uint8))
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
