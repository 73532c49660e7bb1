"""The sparsifier baselines: randomk, dgc, redsync, gaussiank, threshold.

Selection rules on hand-made inputs (exact indices), statistical behaviour with
fixed seeds (tolerances), state round trips and bad input.
"""

import contextlib
import copy
import importlib
import math
import subprocess
import sys
from functools import partial

import pytest
import torch
from scipy import stats
from torch.utils._python_dispatch import TorchDispatchMode

import gradsift
from gradsift.compressors import gaussiank, kernels, scatter_mean
from gradsift.compressors.randomk import SharedIndexPayload, first_distinct, stream_seed
from gradsift.core.errors import InvalidOptionError
from support import models

BASELINES = ["randomk", "dgc", "redsync", "gaussiank", "threshold"]


def build(name, ratio=0.01, threshold=1.0, **options):
    """A baseline with ``ratio`` (``threshold`` instead for the fixed-threshold method)."""
    if name == "threshold":
        return gradsift.get_compressor(name, threshold=threshold, **options)
    return gradsift.get_compressor(name, ratio=ratio, **options)


#: Standard Laplace samples (inverse CDF), reproducible from ``seed``: ``laplace(n, seed)``.
laplace = partial(models.laplace, by="inverse_cdf")


def assert_top_set(x, indices):
    """The selection is an upper set of |x|: nothing left out is larger than anything sent;
    and it is not empty unless x is all zero (an empty selection is an upper set too, of
    nothing a sparsifier should send)."""
    a = x.abs()
    mask = torch.zeros_like(a, dtype=torch.bool)
    mask[indices] = True
    assert mask.any() or not a.any(), "nothing selected from a non-zero gradient"
    if mask.any() and (~mask).any():
        assert a[mask].min() >= a[~mask].max()


def test_the_upper_set_check_fails_where_it_should():
    x = torch.tensor([0.5, -2.0, 1.0, 0.0])
    assert_top_set(x, torch.tensor([1, 2]))
    assert_top_set(x, torch.arange(4))
    assert_top_set(torch.zeros(4), torch.tensor([], dtype=torch.long))
    for wrong in ([], [0], [1, 0]):
        with pytest.raises(AssertionError):
            assert_top_set(x, torch.tensor(wrong, dtype=torch.long))


# --- threshold -------------------------------------------------------------------------


def test_threshold_selects_strictly_above_eta():
    x = torch.tensor([0.5, -2.0, 1.0, 3.0, -1.0001, 0.0, -1.0])
    p = build("threshold", threshold=1.0).compress(x)
    assert p.indices.tolist() == [1, 3, 4]
    assert p.values.tolist() == x[[1, 3, 4]].tolist()


def test_threshold_options_report_eta_and_no_ratio():
    c = build("threshold", threshold=0.25)
    assert c.options() == {"threshold": 0.25, "first_ratio": 0.01}
    with pytest.raises(InvalidOptionError, match="no option.*ratio.*threshold"):
        gradsift.get_compressor("threshold", threshold=1.0, ratio=0.1)
    with pytest.raises(InvalidOptionError, match="'threshold' needs threshold="):
        gradsift.get_compressor("threshold")


@pytest.mark.parametrize("eta", [0.0, -1.0, float("inf"), float("nan"), "1", True])
def test_threshold_rejects_bad_eta(eta):
    with pytest.raises(InvalidOptionError, match="threshold"):
        gradsift.get_compressor("threshold", threshold=eta)


def counted_passes(monkeypatch: pytest.MonkeyPatch, module_name: str) -> list[int]:
    """Counts the calls of ``counts.count_above`` (a count pass over the tensor) made by the
    compressor module ``module_name``: the list's one entry, updated as they happen."""
    module = importlib.import_module(f"gradsift.compressors.{module_name}")
    passes, count = [0], module.count_above

    def counting(values: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
        passes[0] += 1
        return count(values, eta)

    monkeypatch.setattr(module, "count_above", counting)
    return passes


# --- redsync ---------------------------------------------------------------------------


def test_redsync_binary_search_lands_in_bracket():
    # |x| = 1..100: mean 50.5, max 100, eta(r) = 50.5 + 49.5 r; k = 5, bracket [5, 10].
    # r = 1/2 -> eta 75.25 -> 25 above (> 10): lo = 1/2
    # r = 3/4 -> eta 87.625 -> 13 above (> 10): lo = 3/4
    # r = 7/8 -> eta 93.8125 -> 7 above: in [5, 10], stop; send values 94..100.
    x = torch.arange(1.0, 101.0) * torch.tensor([1.0, -1.0]).repeat(50)
    p = build("redsync", ratio=0.05).compress(x)
    assert sorted(p.indices.tolist()) == list(range(93, 100))


def test_redsync_out_of_iterations_sends_last_r_with_enough():
    x = torch.arange(1.0, 101.0)
    p = build("redsync", ratio=0.05, iterations=1).compress(x)  # only r = 1/2: 25 elements
    assert sorted(p.indices.tolist()) == list(range(75, 100))


def test_redsync_on_the_cpu_ends_its_search_at_the_stop_and_sends_what_the_device_search_sends(monkeypatch):
    """1..100, k = 5, bracket [5, 10]: mean 50.5, max 100; r = 1/2 lets 25 through (76..100),
    r = 3/4 13, r = 7/8 seven (94..100): stop. The CPU search ends there (three count passes);
    a device runs all ten, frozen after the stop."""
    x = torch.arange(1.0, 101.0)
    passes = counted_passes(monkeypatch, "redsync")
    with kernels.device_branch():
        expected = build("redsync", ratio=0.05).compress(x)
    assert passes == [10]
    passes[0] = 0
    sent = build("redsync", ratio=0.05).compress(x)
    assert passes == [3]
    assert sorted(sent.indices.tolist()) == list(range(93, 100))
    assert torch.equal(sent.indices, expected.indices) and torch.equal(sent.values, expected.values)


def test_redsync_cannot_go_below_the_mean():
    # k = 90 but only 50 of 1..100 exceed the mean: every r selects fewer than k.
    p = build("redsync", ratio=0.9).compress(torch.arange(1.0, 101.0))
    assert sorted(p.indices.tolist()) == list(range(50, 100))


def test_redsync_constant_tensor_sends_its_ties_at_the_maximum():
    """Every element ties at M = 3 (eta(r) = M for every r selects none): the elements at the
    maximum are always sent, so error feedback never stalls; under the hook's capacity
    they are cut to k (tests/hook/test_capacity.py)."""
    p = build("redsync", ratio=0.2).compress(torch.full((10,), 3.0))
    assert p.count == 10 and p.values.tolist() == [3.0] * 10
    assert build("redsync", ratio=0.2).compress(torch.zeros(10)).count == 0


# --- gaussiank -------------------------------------------------------------------------


def gaussian_input(tail):
    """96 elements of +-1 (mean 0) followed by ``tail``."""
    return torch.cat([torch.tensor([1.0, -1.0]).repeat(48), torch.tensor(tail)])


def test_gaussiank_first_estimate_in_band_needs_no_correction():
    # sigma = sqrt(1.24) = 1.1136, eta = 2.1701 sigma = 2.4165 (ratio 0.03, k = 3, band [2, 4]):
    # exactly the 3 magnitudes 3.0, 2.5, 2.45 exceed it.
    x = gaussian_input([3.0, -2.5, 2.45, 0.0])
    assert sorted(build("gaussiank", ratio=0.03).compress(x).indices.tolist()) == [96, 97, 98]


def test_gaussiank_halves_threshold_when_under_two_thirds():
    # sigma = 1.0416, eta = 2.2604 selects nothing (< 2/3 k = 2): eta *= 0.5 -> 1.1302
    # selects the four of magnitude 2 and 1.5: inside [2, 4], stop. (Top-k would send 3.)
    x = gaussian_input([2.0, -2.0, 1.5, -1.5])
    assert sorted(build("gaussiank", ratio=0.03).compress(x).indices.tolist()) == [96, 97, 98, 99]


def test_gaussiank_stops_after_three_corrections():
    # 90 zeros and ten +-5, k = 2, band [4/3, 8/3]. sigma = 1.5811, eta0 = 2.3263 sigma = 3.678:
    # 10 above -> x1.5 = 5.517: 0 above -> x0.5 = 2.758: 10 above -> x1.5 = 4.137: 10 above,
    # and three corrections are spent: all ten are sent.
    x = torch.cat([torch.zeros(90), torch.tensor([5.0, -5.0]).repeat(5)])
    assert sorted(build("gaussiank", ratio=0.02).compress(x).indices.tolist()) == list(range(90, 100))


@pytest.mark.parametrize(
    ("outlier", "passes"),
    [(None, 1), (1e4, 3 + 6)],
    ids=["in band at once", "settled at the fifth rescue"],
)
def test_gaussiank_on_the_cpu_stops_once_settled_and_sends_the_device_loops_payload(
    outlier, passes, monkeypatch
):
    """On a device every correction and rescue runs (frozen by ``torch.where``, no host read);
    on the CPU the loop stops at the first count inside the band. The payload must be the
    device loop's. With two outliers of 1e4 among 10,000 standard normals the fit's sigma is
    about 141 and eta0 = 2.58 sigma = 364: three corrections (to 45.5) and four rescues (to
    2.84) leave fewer than 2/3 k = 66 passing; the fifth (1.42) lets about 1,500 through."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    if outlier is not None:
        x[[10, 20]] = torch.tensor([outlier, -outlier])
    counted = counted_passes(monkeypatch, "gaussiank")
    on_device = build("gaussiank", ratio=0.01)
    with kernels.device_branch():
        expected = on_device.compress(x)
    assert counted == [gaussiank.CORRECTIONS + gaussiank.RESCUES]  # a device runs every one
    counted[0] = 0
    sent = build("gaussiank", ratio=0.01).compress(x)
    assert counted == [passes]
    assert torch.equal(sent.indices, expected.indices) and torch.equal(sent.values, expected.values)


def test_gaussiank_threshold_is_sign_symmetric():
    # mu = -5.75, sigma = 3.269; eta = |mu| + 1.96 sigma = 12.16 selects the five -20s.
    # (mu + 1.96 sigma = 0.66 would select all 100.)
    x = torch.cat([torch.full((95,), -5.0), torch.full((5,), -20.0)])
    assert sorted(build("gaussiank", ratio=0.05).compress(x).indices.tolist()) == list(range(95, 100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("branch", [contextlib.nullcontext, kernels.device_branch], ids=["cpu", "device"])
def test_a_selection_with_the_maximum_sends_the_ties_at_it_and_nothing_of_zeros(dtype, branch):
    """``|g| > eta`` or ``|g| >= top > 0`` (brute force), with ``eta`` at or above the top;
    zeros send nothing; a NaN is selected and flagged."""
    from gradsift.compressors.threshold import selection_with_maximum

    x = torch.tensor([3.0, -3.0, 1.0, 0.0, 3.0, -2.0], dtype=dtype)
    top = x.abs().max()
    with branch():
        for eta in (5.0, 3.0, 1.5):
            chosen = selection_with_maximum(x, torch.tensor(eta, dtype=dtype), top, None)
            expected = [i for i, v in enumerate(x.abs().tolist()) if v > eta or v >= float(top)]
            assert chosen.indices.tolist() == expected and not bool(chosen.nonfinite)
        zeros = torch.zeros(6, dtype=dtype)
        assert selection_with_maximum(zeros, zeros.max(), zeros.max(), None).indices.numel() == 0
        x[2] = math.nan
        flagged = selection_with_maximum(x, torch.tensor(5.0, dtype=dtype), x.abs().max(), None)
        assert 2 in flagged.indices.tolist() and bool(flagged.nonfinite)


def test_gaussiank_constant_tensor_sends_its_ties_at_the_maximum():
    assert build("gaussiank", ratio=0.3).compress(torch.full((10,), -2.0)).count == 10
    assert build("gaussiank", ratio=0.3).compress(torch.zeros(10)).count == 0


# --- dgc -------------------------------------------------------------------------------


def test_dgc_count_near_k_on_laplace_data():
    # A 1% sample of 10^6 holds 10^4 magnitudes; eta is its 100th largest, so the count
    # has a relative spread of about 1/sqrt(100) and rarely needs trimming.
    x = laplace(1_000_000, seed=1)
    k = 10_000
    c = build("dgc", ratio=0.01)
    counts = []
    for _ in range(20):
        p = c.compress(x)
        assert_top_set(x, p.indices)
        counts.append(p.count)
    assert all(k / 2 <= count <= 4 * k / 3 for count in counts)
    assert abs(sum(counts) / len(counts) / k - 1) < 0.05


def test_dgc_trims_over_selection_to_exact_topk():
    # A one-element sample puts eta anywhere: over-selections are cut to the exact top k,
    # far-too-few falls back to it, so every count lies in [k/2, 4/3 k].
    x = laplace(10_000, seed=2)
    c = build("dgc", ratio=0.01, sample_ratio=1e-4, min_sample=1, seed=5)
    top = set(torch.topk(x.abs(), 100).indices.tolist())
    counts = []
    for _ in range(30):
        p = c.compress(x)
        assert_top_set(x, p.indices)
        counts.append(p.count)
        if p.count == 100:
            assert set(p.indices.tolist()) == top
    assert all(50 <= count <= 133 for count in counts)
    assert counts.count(100) >= 10


def test_dgc_ties_at_eta_are_selected_then_cut_to_k():
    # Every sampled magnitude is 1, so eta = 1: all 10^4 tie at it, more than 4/3 k, so the
    # hierarchical top-k sends k of them.
    assert build("dgc", ratio=0.01).compress(torch.ones(10_000)).count == 100


def test_dgc_seed_and_state_round_trip():
    x = laplace(50_000, seed=3)
    a, b = build("dgc", ratio=0.01, seed=7), build("dgc", ratio=0.01, seed=7)
    assert torch.equal(a.compress(x).indices, b.compress(x).indices)
    saved = a.state_dict()
    first = a.compress(x).indices
    restored = build("dgc", ratio=0.01, seed=7)
    restored.load_state_dict(saved)
    assert torch.equal(restored.compress(x).indices, first)
    other = build("dgc", ratio=0.01, seed=8).compress(x).indices
    assert not torch.equal(other, build("dgc", ratio=0.01, seed=7).compress(x).indices)


# --- randomk ---------------------------------------------------------------------------


def test_first_distinct_marks_the_first_appearance_of_each_value():
    draws = torch.tensor([5, 3, 5, 1, 3, 7, 1])
    assert draws[first_distinct(draws)].tolist() == [5, 3, 1, 7]
    draws = torch.randint(50, (400,))
    expected = list(dict.fromkeys(draws.tolist()))
    assert draws[first_distinct(draws)].tolist() == expected


def test_randomk_same_indices_for_same_seed_step_key():
    x, y = torch.randn(10_000), torch.randn(10_000)
    a, b = build("randomk", seed=3), build("randomk", seed=3)
    pa = [a.compress(x, key="w").indices for _ in range(3)]
    pb = [b.compress(y, key="w").indices for _ in range(3)]  # other data, same positions
    for ia, ib in zip(pa, pb, strict=True):
        assert torch.equal(ia, ib)
    assert not torch.equal(pa[0], pa[1])  # steps differ
    assert not torch.equal(pa[0], build("randomk", seed=3).compress(x, key="v").indices)
    assert not torch.equal(pa[0], build("randomk", seed=4).compress(x, key="w").indices)
    assert a.state_dict() == {"steps": {"w": 3}}


def test_randomk_indices_are_uniform():
    # 2000 draws of 10 of 100 positions: each position expected 200 times.
    c = build("randomk", ratio=0.1)
    x = torch.randn(100)
    counts = torch.zeros(100)
    for _ in range(2000):
        indices = c.compress(x).indices
        assert indices.unique().numel() == 10
        counts[indices] += 1
    chi2 = float(((counts - 200) ** 2 / 200).sum())
    assert stats.chi2.sf(chi2, df=99) > 1e-3
    # No position is favoured by its place in the stream either: first draws are uniform too.
    firsts = torch.stack([c.compress(x).indices[0] for _ in range(2000)])
    chi2_first = float(((torch.bincount(firsts, minlength=100) - 20) ** 2 / 20).sum())
    assert stats.chi2.sf(chi2_first, df=99) > 1e-3


@pytest.mark.parametrize("ratio", [0.4, 0.6, 1.0])
def test_randomk_large_ratio_gives_k_distinct(ratio):
    p = build("randomk", ratio=ratio).compress(torch.randn(999))
    k = int(999 * ratio)
    assert p.count == k and p.indices.unique().numel() == k


def test_randomk_payload_is_allreduce_ready():
    xs = [torch.randn(1000) for _ in range(3)]
    payloads = [build("randomk", ratio=0.05, seed=1).compress(x, key=0) for x in xs]
    p = payloads[0]
    assert isinstance(p, SharedIndexPayload) and not p.variable_size
    assert p.indices.dtype == torch.int64  # drawn as int32, handed out as int64 (index_fill_ needs it)
    assert list(p.fields()) == ["values"]
    assert p.nbytes == 50 * 4  # k fp32 values, no indices, no header
    assert gradsift.get_compressor("randomk").exchanges == ("allreduce",)
    # What the hook does: allreduce the values, divide by W, scatter at the local indices.
    reduced = SharedIndexPayload(
        numel=1000, dtype=torch.float32, values=sum(q.values for q in payloads) / 3, indices=p.indices
    )
    torch.testing.assert_close(scatter_mean([reduced], 1000), scatter_mean(payloads, 1000))


def test_randomk_state_round_trip_resumes_the_stream():
    x = torch.randn(5000)
    a = build("randomk")
    for _ in range(4):
        a.compress(x, key=("bucket", 1))
    b = build("randomk")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.compress(x, key=("bucket", 1)).indices, b.compress(x, key=("bucket", 1)).indices)
    with pytest.raises(InvalidOptionError, match="steps"):
        b.load_state_dict({"steps": {0: -1}})


@pytest.mark.slow
def test_randomk_stream_is_identical_in_another_process():
    # hash() is salted per process; the seed derivation must not be.
    code = (
        "import torch, gradsift\n"
        "from gradsift.compressors.randomk import stream_seed\n"
        "c = gradsift.get_compressor('randomk', ratio=0.01, seed=9)\n"
        "c.load_state_dict({'steps': {'layer1.weight': 5}})\n"
        "print(stream_seed(9, 'layer1.weight', 5))\n"
        "print(c.compress(torch.zeros(10_000), key='layer1.weight').indices.tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.split("\n")
    c = build("randomk", seed=9)
    c.load_state_dict({"steps": {"layer1.weight": 5}})
    assert int(out[0]) == stream_seed(9, "layer1.weight", 5)
    assert out[1] == str(c.compress(torch.zeros(10_000), key="layer1.weight").indices.tolist())


# --- every baseline --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgc", "redsync", "gaussiank", "threshold"])
def test_threshold_methods_send_an_upper_set(name):
    for seed in range(5):
        x = laplace(20_000, seed=seed) * math.exp(seed - 2)
        assert_top_set(x, build(name, ratio=0.01, threshold=4.0 * math.exp(seed - 2)).compress(x).indices)


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 777, 9999])
def test_nonfinite_gradient_raises(name, bad, position):
    x = torch.randn(10_000) * 0.01
    x[position] = bad
    with pytest.raises(gradsift.NonFiniteGradientError):
        build(name).compress(x)


@pytest.mark.parametrize(("name", "options"), [("dgc", {}), ("sidco-exp", {"adapt": False})])
@pytest.mark.parametrize("bad", [math.nan, -math.nan, math.inf])
@pytest.mark.parametrize("branch", ["cpu", "device"])
def test_a_bad_element_in_the_sample_the_threshold_comes_from_raises(name, options, bad, branch):
    """Every tenth element bad: DGC's sample of 1024 draws holds about a hundred, so its
    sampled quantile is NaN or Inf; SIDCo's fixed fit samples all of a tensor this small."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 0.01
    x[::10] = bad
    compressor = gradsift.get_compressor(name, ratio=0.01, **options)
    branch_of = kernels.device_branch if branch == "device" else contextlib.nullcontext
    with branch_of(), pytest.raises(gradsift.NonFiniteGradientError):
        compressor.compress(x)


@pytest.mark.parametrize("name", BASELINES)
def test_integer_tensor_is_a_type_error(name):
    with pytest.raises(TypeError, match="floating dtype"):
        build(name).compress(torch.arange(100))


@pytest.mark.parametrize("name", ["randomk", "dgc", "redsync", "gaussiank"])
@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1", None])
def test_bad_ratio_names_ratio(name, ratio):
    with pytest.raises(InvalidOptionError, match="ratio"):
        gradsift.get_compressor(name, ratio=ratio)


@pytest.mark.parametrize(
    "name,option,value",
    [
        ("randomk", "seed", -1),
        ("randomk", "seed", 1.5),
        ("dgc", "sample_ratio", 0.0),
        ("dgc", "sample_ratio", 2.0),
        ("dgc", "min_sample", 0),
        ("dgc", "seed", "0"),
        ("redsync", "iterations", 0),
        ("redsync", "iterations", 65),
    ],
)
def test_bad_option_names_the_option(name, option, value):
    with pytest.raises(InvalidOptionError, match=option):
        gradsift.get_compressor(name, **{option: value})


@pytest.mark.parametrize("name", BASELINES)
def test_unknown_option_lists_accepted_ones(name):
    with pytest.raises(InvalidOptionError, match="no option.*bogus"):
        gradsift.get_compressor(name, bogus=1)


@pytest.mark.parametrize("name", BASELINES)
def test_empty_and_shaped_input(name):
    c = build(name, ratio=0.1)
    empty = c.compress(torch.empty(0, 3))
    assert empty.count == 0 and empty.numel == 0
    x = laplace(600, seed=4).reshape(20, 5, 6).double()
    p = c.compress(x)
    assert p.dtype == torch.float64 and p.numel == 600
    assert torch.equal(p.values, x.reshape(-1)[p.indices])


def test_threshold_selection_spans_chunks_and_checks_every_chunk():
    from gradsift.compressors.kernels import SELECTION_CHUNK

    x = torch.randn(2 * SELECTION_CHUNK + 7, generator=torch.Generator().manual_seed(4))
    compressor = gradsift.get_compressor("threshold", threshold=2.0)
    p = compressor.compress(x)
    assert torch.equal(p.indices, (x.abs() > 2.0).nonzero().view(-1))
    x[2 * SELECTION_CHUNK + 3] = float("nan")  # only the last, short chunk is bad
    with pytest.raises(gradsift.NonFiniteGradientError):
        compressor.compress(x)


# --- the DDP hook's skipped-step contract ------------------------------------------------

STATEFUL = ["randomk", "dgc", "sidco-exp", "sidco-gpareto", "sidco-gamma"]


def _equal(a, b) -> bool:
    """Structural equality of nested dicts/lists of numbers and tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _tensors(value)


@pytest.mark.parametrize("numel", [1000, 200_000])
@pytest.mark.parametrize("name", STATEFUL)
def test_restored_state_replays_a_skipped_step_exactly(name, numel):
    """compress -> state_dict -> compress -> load_state_dict -> compress: the last call repeats the second.

    This is how the DDP hook undoes a skipped step (mixed-precision overflow); the
    snapshot is taken every step, so it must also be small and not alias live state.
    """
    compressor = build(name)
    stream = [laplace(numel, seed) * (1 + seed) for seed in range(3)]
    for x in stream[:2]:
        compressor.compress(x, key="bucket")
    saved = compressor.state_dict()
    snapshot = copy.deepcopy(saved)
    second = compressor.compress(stream[2], key="bucket")
    assert not _equal(compressor.state_dict(), snapshot)  # the call advanced the state ...
    assert _equal(saved, snapshot)  # ... and the exported snapshot did not move with it
    compressor.load_state_dict(saved)
    third = compressor.compress(stream[2], key="bucket")
    assert torch.equal(second.indices, third.indices) and torch.equal(second.values, third.values)
    uninterrupted = build(name)
    for x in stream:
        uninterrupted.compress(x, key="bucket")
    assert _equal(compressor.state_dict(), uninterrupted.state_dict())
    assert all(t.numel() * t.element_size() <= 8192 for t in _tensors(saved))  # no gradient-sized tensors


# --- decompress_into: the hook's in-place decoding ---------------------------------------
@pytest.mark.parametrize("name", [*BASELINES, "topk", "sidco-exp"])
def test_decompress_into_writes_what_decompress_returns_over_stale_contents(name):
    grads = [laplace(5000, seed) for seed in (1, 2, 3)]
    compressor = build(name, ratio=0.02, threshold=1.5)
    payloads = [compressor.compress(g, key=w) for w, g in enumerate(grads)]
    out = torch.full((5000,), 7.0)  # stale contents (the bucket's gradient) must not leak through
    compressor.decompress_into(payloads, out)
    assert torch.equal(out, compressor.decompress(payloads, 5000))


def test_decompress_into_keeps_a_subclass_own_decoding():
    class Doubled(type(build("topk"))):
        def decompress(self, payloads, numel):
            return 2 * super().decompress(payloads, numel)

    compressor = Doubled(ratio=0.1)
    payload = compressor.compress(laplace(100, 4))
    out = torch.empty(100)
    compressor.decompress_into([payload], out)
    assert torch.equal(out, 2 * scatter_mean([payload], 100))


def test_scatter_mean_refuses_an_out_of_the_wrong_size_and_casts_into_another_dtype():
    payload = build("topk", ratio=0.1).compress(laplace(100, 5))
    with pytest.raises(InvalidOptionError, match="out holds 99 elements"):
        scatter_mean([payload], 100, out=torch.empty(99))
    # a bf16 bucket of fp32 payloads: summed in fp32, then cast once
    half = scatter_mean([payload, payload], 100, out=torch.full((100,), 7.0, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(
        half, scatter_mean([payload, payload], 100).bfloat16()
    )


def test_scatter_mean_scales_the_received_values_not_the_dense_result():
    # 1/W goes on the W k received entries: the only ops over the n-element result are its
    # zeroing and one index_add_ per worker (no division pass over the bucket), and the mean is exact
    n, world = 4096, 4
    payloads = [build("topk", ratio=0.01).compress(laplace(n, 60 + w)) for w in range(world)]

    class Dense(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == n:
                self.ops.append(func.overloadpacket.__name__)
            return out

    with Dense() as seen:
        mean = scatter_mean(payloads, n)
    assert seen.ops == ["zeros"] + ["index_add_"] * world
    reference = torch.zeros(n)
    for payload in payloads:
        reference[payload.indices] += payload.values
    torch.testing.assert_close(mean, reference / world, rtol=0, atol=1e-7)
