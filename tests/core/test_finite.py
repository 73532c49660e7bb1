"""The one non-finite check (gradsift.core.finite): NaN/Inf found in every float dtype, finite
values whose sum overflows their own dtype never flagged, and no other sum-based check in src/."""

from __future__ import annotations

import re

import pytest
import torch

from gradsift.core.finite import nonfinite
from support import ROOT


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


def test_no_other_module_checks_finiteness_by_a_sum():
    """Every sum-then-isfinite check in src/ is this one (the count the issue asks for)."""
    pattern = re.compile(r"isfinite\([^()]*\.sum\(")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "src" / "gradsift").rglob("*.py")
        if path.name != "finite.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
