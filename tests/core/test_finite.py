"""The one non-finite check (gradsift.core.finite): NaN/Inf found in every float dtype, finite
values whose sum overflows their own dtype never flagged (that no other module checks by a sum:
tests/project/test_one_implementation.py); a dropped step's fill written only when the flag
holds, read on the host only from CPU memory."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch

from gradsift.core.finite import fill_where, host_value, nonfinite
from support.fake_cuda import fake_cuda, on_fake_cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nan_and_inf_are_found_anywhere(dtype):
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.ones(1000, dtype=dtype)
        values[637] = bad
        assert bool(nonfinite(values))
        assert bool(nonfinite(torch.ones(3, dtype=dtype), values))  # in the second of two
    assert not bool(nonfinite(torch.ones(1000, dtype=dtype)))


def test_finite_values_whose_own_dtype_sum_overflows_are_not_flagged():
    half = torch.full((4,), 40000.0, dtype=torch.float16)
    assert not torch.isfinite(half.sum())  # fp16's own sum: 160000 > 65504
    assert not bool(nonfinite(half))
    large = torch.full((8,), 3.0e38, dtype=torch.float32)
    assert not torch.isfinite(large.sum())  # fp32's own sum overflows too
    assert not bool(nonfinite(large))
    assert not bool(nonfinite(torch.full((8,), 3.0e38, dtype=torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_tensor_beyond_one_chunk_is_checked_in_every_chunk(monkeypatch, dtype):
    """The partial sums (a chunk's widened copy, not the tensor's) find a NaN or Inf in any
    chunk, the short last one included, and flag no finite values whose sum overflows."""
    from gradsift.core import finite

    monkeypatch.setattr(finite, "CHUNK", 64)
    for at in (0, 63, 64, 200, 249):
        for bad in (float("nan"), float("-inf")):
            values = torch.ones(250, dtype=dtype)
            values[at] = bad
            assert bool(nonfinite(values)) and bool(nonfinite(values.view(10, 25)))
    assert not bool(nonfinite(torch.full((250,), 40000.0 if dtype == torch.float16 else 3.0e38, dtype=dtype)))


# -- what a dropped step writes: fill_where ------------------------------------------------------
class _Writes(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten operators run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("value", [float("nan"), 0.0])
def test_a_cpu_flag_fills_the_tensor_when_it_holds_and_leaves_it_unread_otherwise(value):
    tensor = torch.randn(1000)
    before = tensor.clone()
    with _Writes() as spared:
        fill_where(tensor, torch.tensor(False), value)
    assert torch.equal(tensor, before) and not any("fill" in op for op in spared.ops)
    fill_where(tensor, torch.tensor(True), value)
    expected = torch.full_like(before, value)
    assert torch.equal(tensor, expected) or (tensor.isnan().all() and expected.isnan().all())


def test_host_value_reads_a_cpu_flag_and_leaves_a_device_flag_alone(monkeypatch):
    assert host_value(torch.tensor(True)) is True and host_value(torch.tensor(False)) is False
    with fake_cuda(monkeypatch):
        flag = torch.zeros((), dtype=torch.bool, device="cuda")
        tensor = torch.zeros(8, device="cuda")
        assert host_value(flag) is None
        fill_where(tensor, flag, float("nan"))  # a masked_fill_ on the device: a host read would raise
        assert on_fake_cuda(tensor)
