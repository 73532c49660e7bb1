"""gradsift.kernels: the comparison kernels (NumPy on CPU, PyTorch elsewhere) and the one-thread section."""

import math

import pytest
import torch

import gradsift
from gradsift import kernels
from gradsift.errors import InvalidOptionError
from gradsift.kernels import (
    PARALLEL_GRAIN,
    SELECTION_CHUNK,
    CallingThreadOnly,
    counts_above,
    select_above_threshold,
    values_above,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_selection_is_the_nan_inclusive_mask_across_chunks(dtype):
    x = torch.randn(2 * SELECTION_CHUNK + 12345, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[SELECTION_CHUNK - 1] = 9.0  # both sides of a chunk border
    x[SELECTION_CHUNK] = -9.0
    x[7] = 2.5  # exactly eta: not selected (strictly above)
    x[SELECTION_CHUNK + 5] = math.nan  # NaN is selected, so checking the selection checks all
    x[11] = -math.inf
    x[12] = -0.0
    for eta in (2.5, 0.3, 0.0):  # 0.3 is not representable in 16 bits: compared in the dtype, like torch
        indices = select_above_threshold(x, eta)
        assert indices.dtype == torch.int64
        assert torch.equal(indices, torch.nonzero(~(x.abs() <= eta)).view(-1))
    indices = select_above_threshold(x, 2.5).tolist()
    assert SELECTION_CHUNK + 5 in indices and 11 in indices and 7 not in indices


def test_selection_of_a_short_strided_tensor_and_bad_eta():
    x = torch.tensor([0.0, -1.0, 0.0, 3.0, 0.5, -2.0])[::2]  # a view with stride 2: 0, 0, 0.5
    assert select_above_threshold(x, 0.0).tolist() == [2]
    with pytest.raises(InvalidOptionError, match="eta must be >= 0"):
        select_above_threshold(x, -1.0)


def test_numpy_and_torch_branches_agree():
    """float32 runs through NumPy, float16 through PyTorch; on values exact in both, the results agree."""
    values = torch.arange(2000, dtype=torch.float32) / 8  # multiples of 1/8 up to 250: exact in fp16
    half = values.half()
    for eta in (0.0, 17.125, 100.0, 249.875):
        assert torch.equal(values_above(values, eta), values[values > eta])
        assert torch.equal(values_above(half, eta).float(), values[values > eta])
    thresholds = [0.0, 17.125, 100.0, 300.0]
    assert counts_above(values, thresholds) == counts_above(half, thresholds) == [1999, 1862, 1199, 0]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pytorch_branch_the_gpu_runs_selects_what_numpy_selects(monkeypatch, dtype):
    """On a GPU every kernel takes its PyTorch branch; forced here on CPU, the results must not change."""
    x = torch.distributions.StudentT(3.0).sample((2 * SELECTION_CHUNK + 99,)).to(dtype)
    x[5] = math.nan
    reference = select_above_threshold(x, 1.5)
    numpy_run = [gradsift.get_compressor(name, ratio=0.01) for name in ("sidco-exp", "sidco-gpareto", "dgc")]
    expected = [[c.compress(x.nan_to_num(), key=0).indices for _ in range(3)] for c in numpy_run]
    monkeypatch.setattr(kernels, "uses_numpy", lambda tensor: False)
    assert torch.equal(select_above_threshold(x, 1.5), reference)
    torch_run = [gradsift.get_compressor(name, ratio=0.01) for name in ("sidco-exp", "sidco-gpareto", "dgc")]
    for compressor, indices in zip(torch_run, expected, strict=True):
        for want in indices:
            assert torch.equal(compressor.compress(x.nan_to_num(), key=0).indices, want), compressor.name
