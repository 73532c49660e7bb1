"""The option checks' messages name the interval a value must lie in, an unbounded end open."""

from __future__ import annotations

import math

import pytest

from gradsift.core.errors import InvalidOptionError
from gradsift.core.validation import check_int, check_real


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: check_int(0, "steps", low=1), "steps must lie in [1, inf), got 0"),
        (lambda: check_int(9, "depth", high=4), "depth must lie in (-inf, 4], got 9"),
        (lambda: check_int(-1, "rank", low=0, high=3), "rank must lie in [0, 3], got -1"),
        (lambda: check_int(1.5, "steps", low=1), "steps must be an integer, got 1.5"),
        (lambda: check_real(-1, "lr", low=0.0, low_open=True), "lr must lie in (0.0, inf), got -1.0"),
        (lambda: check_real(2, "x", high=1.0, high_open=True), "x must lie in (-inf, 1.0), got 2.0"),
        (
            lambda: check_real(2, "ratio", low=0.0, high=1.0, low_open=True),
            "ratio must lie in (0.0, 1.0], got 2.0",
        ),
        (lambda: check_real(math.inf, "lr", low=0.0), "lr must be finite, got inf"),
    ],
)
def test_a_value_outside_its_interval_is_refused_naming_the_interval(check, message):
    with pytest.raises(InvalidOptionError) as refused:
        check()
    assert str(refused.value) == message


def test_a_value_inside_its_interval_is_returned():
    assert check_int(5, "steps", low=1) == 5 and check_real(3, "lr", low=0.0, low_open=True) == 3.0
