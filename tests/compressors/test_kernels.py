"""gradsift.compressors.kernels: the selection kernels (NumPy on CPU, PyTorch without host reads elsewhere),
keeping the largest, the top-k's radix select (gradsift.compressors.largest), zeroing in place, and the
one-thread section."""

import contextlib
import math

import pytest
import torch

from gradsift.compressors import kernels, largest, radix, tail_kernels
from gradsift.compressors.counts import count_above
from gradsift.compressors.kernels import (
    PARALLEL_GRAIN,
    SELECTION_CHUNK,
    CallingThreadOnly,
    Candidates,
    keep_largest,
    select_above,
    select_mask,
    zero_at,
)
from gradsift.core.errors import InvalidOptionError


def nan_inclusive(x: torch.Tensor, eta: float) -> torch.Tensor:
    """The reference: every position with ``not (|x| <= eta)`` (NaN included), by brute force."""
    return torch.nonzero(~(x.abs() <= eta)).view(-1)


def hard_input(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(2 * SELECTION_CHUNK + 12345, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[SELECTION_CHUNK - 1] = 9.0  # both sides of a chunk border
    x[SELECTION_CHUNK] = -9.0
    x[7] = 2.5  # exactly eta: not selected (strictly above)
    x[SELECTION_CHUNK + 5] = math.nan  # NaN is selected, so checking the selection checks all
    x[11] = -math.inf
    x[12] = -0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_selection_is_the_nan_inclusive_mask_across_chunks(dtype):
    x = hard_input(dtype)
    for eta in (2.5, 0.3, 0.0):  # 0.3 is not representable in 16 bits: compared in the dtype, like torch
        found = select_above(x, eta)
        assert found.indices.dtype == torch.int64 and found.length is None
        assert torch.equal(found.indices, nan_inclusive(x, eta)) and found.selected == found.indices.numel()
        assert bool(found.nonfinite)
    assert 7 not in select_above(x, 2.5).indices.tolist()
    clean = torch.ones(10, dtype=dtype)
    assert not bool(select_above(clean, 0.5).nonfinite)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eta", [2.5, 0.1 + 1e-9, math.nan, math.inf])
def test_a_count_above_is_the_count_of_the_strict_comparison_in_the_dtype(dtype, eta):
    """Brute force: the Python count of ``float(v) > float(eta rounded to the dtype)`` over the
    values (NaN nowhere; chunk borders; ``eta`` a float64 0-d tensor, so its rounding to the
    values' dtype matters), on the CPU branch and the device branch."""
    values = hard_input(dtype).abs()
    bound = float(torch.tensor(eta, dtype=torch.float64).to(dtype))
    expected = sum(1 for v in values.tolist() if v > bound)
    threshold = torch.tensor(eta, dtype=torch.float64)
    assert count_above(values, threshold).dtype == torch.int64
    assert int(count_above(values, threshold)) == expected
    with kernels.device_branch():
        assert int(count_above(values, threshold)) == expected


def test_selection_of_a_short_strided_tensor_a_tensor_threshold_and_bad_eta():
    x = torch.tensor([0.0, -1.0, 0.0, 3.0, 0.5, -2.0])[::2]  # a view with stride 2: 0, 0, 0.5
    assert select_above(x, 0.0).indices.tolist() == [2]
    assert select_above(x, torch.tensor(0.25, dtype=torch.float64)).indices.tolist() == [2]
    with pytest.raises(InvalidOptionError, match="eta must be >= 0"):
        select_above(x, -1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eta", [math.nan, -math.nan, math.inf, 1e39])  # 1e39: Inf below float64
def test_a_threshold_that_is_not_finite_in_the_dtype_selects_exactly_the_nan_and_inf(dtype, eta):
    """A threshold estimated from data that held a NaN or an Inf (DGC's sampled quantile,
    SIDCo's fit) is NaN or Inf: NaN and Inf still pass the test on both branches, so the
    check of the selected values still sees them -- and no finite element passes."""
    x = hard_input(dtype)
    bad = torch.nonzero(~x.isfinite()).view(-1)  # the -Inf at 11 and the NaN
    for branch in (contextlib.nullcontext, kernels.device_branch):
        with branch():
            found = select_above(x, eta)
            capped = select_above(x, torch.tensor(eta, dtype=torch.float64), 1)
            clean = select_above(torch.ones(10, dtype=dtype), eta)
        where = f"{eta} on the {branch.__name__} branch"
        assert torch.equal(found.indices, bad) and found.selected == bad.numel(), where
        assert bool(found.nonfinite) and bool(capped.nonfinite), where
        assert capped.indices.tolist() == [SELECTION_CHUNK + 5], where  # the NaN is the largest
        assert clean.indices.numel() == 0 and not bool(clean.nonfinite), where


def largest_by_brute_force(x: torch.Tensor, positions: torch.Tensor, capacity: int) -> list[int]:
    """The ``capacity`` positions of largest ``|x|`` (NaN largest, ties to the lower position),
    ascending: a Python sort of (magnitude, position) pairs."""

    def rank(p: int) -> tuple[bool, float, int]:  # NaN above every number, Inf included
        value = abs(float(x[p]))
        return (math.isnan(value), 0.0 if math.isnan(value) else value, -p)

    return sorted(sorted(positions.tolist(), key=rank, reverse=True)[:capacity])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_branch_selects_what_numpy_selects_at_a_capacity(dtype):
    """On a GPU every kernel takes its PyTorch branch (forced here on CPU): without a
    capacity every position; with one, exactly that many entries (padding 0, the count a
    tensor), the largest when more pass -- the CPU branch's choice."""
    x = hard_input(dtype)
    reference = nan_inclusive(x, 1.5)
    with kernels.device_branch():
        exact = select_above(x, 1.5)
        roomy = select_above(x, torch.tensor(1.5), reference.numel() + 50)
        tight = select_mask(~(x.abs() <= 1.5), 100, x)
    assert torch.equal(exact.indices, reference) and bool(exact.nonfinite)
    assert roomy.indices.numel() == reference.numel() + 50
    assert int(roomy.length) == int(roomy.selected) == reference.numel()
    assert torch.equal(roomy.indices[: reference.numel()], reference)
    assert bool((roomy.indices[reference.numel() :] == 0).all())
    assert int(tight.length) == 100 and int(tight.selected) == reference.numel()
    assert tight.indices.tolist() == largest_by_brute_force(x, reference, 100)
    on_cpu = select_mask(~(x.abs() <= 1.5), 100, x)
    assert torch.equal(on_cpu.indices, tight.indices) and on_cpu.length == 100


def test_select_mask_on_cpu_returns_every_position_with_a_host_count():
    mask = torch.tensor([False, True, True, False, True])
    found = select_mask(mask)  # CPU: the count is free
    assert found.indices.tolist() == [1, 2, 4] and found.length is None and found.selected == 3
    values = torch.tensor([9.0, 1.0, -3.0, 8.0, 2.0])
    cut = select_mask(mask, 2, values)  # the 2 largest of |1|, |-3|, |2|
    assert cut.indices.tolist() == [2, 4] and cut.length == 2 and cut.selected == 3
    with pytest.raises(InvalidOptionError, match="magnitudes_of"):
        select_mask(mask, 2)


def test_ties_go_to_the_lower_position_on_both_branches():
    values = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], dtype=torch.bfloat16)
    mask = torch.ones(6, dtype=torch.bool)
    on_cpu = select_mask(mask, 2, values)
    with kernels.device_branch():
        on_device = select_mask(mask, 2, values)
    assert on_cpu.indices.tolist() == on_device.indices.tolist() == [1, 2]


def test_keep_largest_takes_the_largest_magnitudes_in_position_order():
    values = torch.tensor([0.5, -4.0, 1.0, 3.0, -2.0, math.nan, 0.1])
    exact = Candidates(torch.tensor([0, 1, 2, 3, 4, 5, 6]), None, 7)
    indices, length = keep_largest(values, exact, 3)
    assert indices.tolist() == [1, 3, 5] and length == 3  # NaN counts as the largest
    few = Candidates(torch.tensor([2, 4]), None, 2)
    indices, length = keep_largest(values, few, 4)
    assert indices.tolist() == [2, 4, 0, 0] and length == 2  # padded with 0
    # a fixed room whose first 4 entries are in use (the rest is padding, never chosen)
    padded = Candidates(torch.tensor([0, 2, 3, 6, 0, 0]), torch.tensor(4), torch.tensor(9))
    indices, length = keep_largest(values, padded, 3)  # of 0.5, 1.0, 3.0, 0.1 at 0, 2, 3, 6
    assert int(length) == 3 and indices.tolist() == [0, 2, 3]
    indices, length = keep_largest(values, Candidates(torch.tensor([3, 1, 0, 0]), torch.tensor(2), 2), 3)
    assert indices.tolist() == [1, 3, 0] and int(length) == 2


def test_zero_at_clears_positions_in_use_and_ignores_padding_at_zero():
    tensor = torch.tensor([5.0, 6.0, 7.0, 8.0])
    zero_at(tensor, torch.tensor([0, 2, 0, 0]), torch.tensor([True, True, False, False]))
    assert tensor.tolist() == [0.0, 6.0, 0.0, 8.0]
    tensor = torch.tensor([5.0, 6.0, 7.0, 8.0])
    zero_at(tensor, torch.tensor([3, 0]), torch.tensor([True, False]))  # index 0 only as padding
    assert tensor.tolist() == [5.0, 6.0, 7.0, 0.0]
    zero_at(tensor, torch.tensor([1]), None)
    assert tensor.tolist() == [5.0, 0.0, 7.0, 0.0]


def test_calling_thread_only_restores_the_pool_even_on_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with CallingThreadOnly(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), CallingThreadOnly(torch.device("cpu")):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        with CallingThreadOnly(torch.device("meta")):  # not the CPU: the pool is left alone
            assert torch.get_num_threads() == 2
        # kernels over at most PARALLEL_GRAIN elements never use the pool: left alone
        with CallingThreadOnly(torch.device("cpu"), largest=PARALLEL_GRAIN):
            assert torch.get_num_threads() == 2
        with CallingThreadOnly(torch.device("cpu"), largest=PARALLEL_GRAIN + 1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("compressor", ["sidco-exp", "sidco-gpareto", "sidco-gamma"])
def test_the_cpu_selection_never_enters_blas(monkeypatch, compressor):
    """NumPy's dot products go to BLAS, whose worker threads spin against the other ranks
    on a shared CPU (2 gloo ranks on 2 cores: a 2^18-element moment sum took 6.6 ms with
    ``np.dot``, 0.08 ms on the calling thread). The fitted path, every stage of it, must
    keep its sums on the calling thread."""
    import numpy as np

    from gradsift.compressors.registry import get_compressor
    from gradsift.core.readout import Readout

    def refused(*args, **kwargs):
        raise AssertionError("BLAS call on the CPU selection path")

    for name in ("dot", "vdot", "inner", "matmul", "tensordot"):
        monkeypatch.setattr(np, name, refused)
    sparsifier = get_compressor(compressor, ratio=0.001, exact_below=0)
    flat = torch.randn(1 << 19, generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the first call evaluates every stage count, later ones the current
        readout = Readout()
        sparsifier.select(flat, "key", None, readout)
        readout.read()
        readout.commit()
    count, total, squares, least = tail_kernels.moment_sums(flat.abs())
    wide = flat.abs().double()
    assert count.item() == flat.numel()
    assert total.item() == pytest.approx(wide.sum().item(), rel=1e-12)
    assert squares.item() == pytest.approx((wide * wide).sum().item(), rel=1e-12)
    assert least.item() == wide.min().item()


def test_kept_or_value_with_above_is_the_where_of_both_on_either_branch():
    """The CPU branch skips the quantile when the flag keeps ``eta``; the device branch (forced
    here on CPU tensors) always computes both: the two must agree with the plain where."""
    values = torch.rand(5000, generator=torch.Generator().manual_seed(3))
    eta = torch.tensor(0.5, dtype=torch.float64)
    oracle_quantile = values.sort(descending=True).values[40].double()  # 40 elements above it
    for keep_eta in (True, False):
        flag = torch.tensor(keep_eta)
        expected = eta if keep_eta else oracle_quantile
        assert tail_kernels.kept_or_value_with_above(flag, eta, values, 40).item() == expected.item()
        with kernels.device_branch():
            assert tail_kernels.kept_or_value_with_above(flag, eta, values, 40).item() == expected.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 37, 300, 5000])
def test_the_cpu_radix_select_picks_the_elements_of_one_topk(monkeypatch, dtype, k):
    """Oracle: one ``torch.topk`` of ``|x|`` (distinct magnitudes, so no ties): the radix select
    over several chunks finds the same set, ascending, with the largest all in one chunk and
    NaN and Inf kept (fp16/bf16: one digit pass; fp32: two; fp64: four)."""
    monkeypatch.setattr(radix, "RADIX_CHUNK", 1000)
    monkeypatch.setattr(largest, "ONE_TOPK_BELOW", 100)
    n, top, generator = 10_250, min(k, 300), torch.Generator().manual_seed(3)
    if dtype.itemsize == 2:  # distinct finite magnitude patterns, below fp16's and bf16's Inf
        x = (torch.randperm(0x7BFF, generator=generator)[:n] + 1).to(torch.int16).view(dtype).clone()
    else:
        x = torch.randn(n, generator=generator, dtype=dtype)
    x[torch.rand(n, generator=generator) < 0.5] *= -1
    ranked = x[x.abs().argsort(descending=True)]
    x = torch.cat([ranked[top : top + 2000], ranked[:top], ranked[top + 2000 :]])  # the largest in one chunk
    x[9999], x[10_200] = math.nan, -math.inf
    assert x.abs().unique().numel() == n  # no two magnitudes tie
    magnitudes, indices = largest.largest_magnitudes(x, k)
    oracle = torch.topk(x.abs(), k, sorted=False)
    assert indices.tolist() == sorted(oracle.indices.tolist())
    torch.testing.assert_close(magnitudes, x.abs().index_select(0, indices), rtol=0, atol=0, equal_nan=True)
    with kernels.device_branch():
        _, device = largest.largest_magnitudes(x, k)
    assert sorted(device.tolist()) == indices.tolist()


@pytest.mark.parametrize("k", [1, 3, 250, 999, 1000])
def test_the_cpu_radix_select_breaks_ties_to_the_lower_position(monkeypatch, k):
    """Equal magnitudes (zeros, and +-1 in both signs) are taken in position order, across
    chunks: the order of :func:`kernels.ranking_keys`, whose ``topk`` is the oracle."""
    monkeypatch.setattr(radix, "RADIX_CHUNK", 64)
    monkeypatch.setattr(largest, "ONE_TOPK_BELOW", 10)
    x = torch.zeros(1000)
    x[100:400:3] = 1.0
    x[101:400:3] = -1.0
    x[700] = 2.0
    _, indices = largest.largest_magnitudes(x, k)
    oracle = torch.topk(kernels.ranking_keys(x), k).indices
    assert indices.tolist() == sorted(oracle.tolist())


def test_small_tensors_take_one_topk():
    """Below ``ONE_TOPK_BELOW`` elements the CPU takes one ``topk``, as the device does."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    magnitudes, indices = largest.largest_magnitudes(x, 10)
    assert sorted(indices.tolist()) == sorted(torch.topk(x.abs(), 10).indices.tolist())
    torch.testing.assert_close(magnitudes, x.abs().index_select(0, indices), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eta", [0.0, 0.5, 2.5])
def test_a_selection_far_over_its_capacity_takes_the_largest_of_the_whole_tensor(monkeypatch, dtype, eta):
    """Oracle: the same selection collected whole, then cut by :func:`keep_largest`. Past
    ``COLLECTED_PER_CAPACITY`` times the capacity the CPU stops collecting and takes the
    capacity largest of the whole tensor by the radix select: the same positions (ties --
    the zeros, the rounded values -- to the lower position), every passing element counted,
    the NaN flagged."""
    monkeypatch.setattr(kernels, "SELECTION_CHUNK", 500)
    monkeypatch.setattr(radix, "RADIX_CHUNK", 300)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6)).mul(2).round().div(2).to(dtype)
    x[4321] = math.nan
    overflowed = 0
    for capacity in (1, 40, 400):
        capped = select_above(x, eta, capacity)
        overflowed += capped.selected > 2 * capacity
        with monkeypatch.context() as whole:
            whole.setattr(kernels, "COLLECTED_PER_CAPACITY", 10**9)
            oracle = select_above(x, eta, capacity)
        assert capped.indices.tolist() == oracle.indices.tolist(), capacity
        assert capped.length == oracle.length
        assert capped.selected == oracle.selected == int((~(x.abs() <= eta)).sum())
        assert bool(capped.nonfinite) and bool(oracle.nonfinite)
    assert overflowed  # the radix path ran
