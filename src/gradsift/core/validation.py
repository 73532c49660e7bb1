"""Argument checks shared by every compressor.

Each check raises a :mod:`gradsift.core.errors` exception whose message names the
argument, the value received and the allowed range.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.spelling import NAME_CLOSE, closest, did_you_mean

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_ratio(value: object, name: str = "ratio") -> float:
    """Return ``value`` as a float density in (0, 1]; raise otherwise."""
    return check_real(value, name, low=0.0, high=1.0, low_open=True)


def check_real(
    value: object,
    name: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a finite float inside the given interval; raise otherwise."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidOptionError(f"{name} must be a real number, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise InvalidOptionError(f"{name} must be a number, got NaN")
    if math.isinf(number):
        raise InvalidOptionError(f"{name} must be finite, got {number!r}")
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if below or above:
        left = "(" if low_open or low == -math.inf else "["  # an infinite end is open: finite only
        right = ")" if high_open or high == math.inf else "]"
        raise InvalidOptionError(f"{name} must lie in {left}{low}, {high}{right}, got {number!r}")
    return number


def check_int(value: object, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an int inside ``[low, high]`` (None: unbounded on that side); raise otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        left = "(-inf" if low is None else f"[{low}"
        right = "inf)" if high is None else f"{high}]"
        raise InvalidOptionError(f"{name} must lie in {left}, {right}, got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool (not merely truthy); raise otherwise."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(
    value: object, name: str, choices: tuple[str, ...], error: type[ValueError] = InvalidOptionError
) -> str:
    """Return ``value`` if it is one of ``choices``; raise ``error`` listing them otherwise, with
    the closest of them to a string (:func:`gradsift.core.spelling.closest`, at the registry
    names' cutoff: choices are short names)."""
    if value not in choices:
        close = closest(value.lower(), choices, NAME_CLOSE) if isinstance(value, str) else None
        hint = did_you_mean([repr(close)] if close else [])
        raise error(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")
    return value


def as_flat_gradient(tensor: object, name: str = "tensor") -> torch.Tensor:
    """Return a contiguous 1-D view (or copy) of a floating-point tensor.

    Raises :class:`InvalidTensorError` for non-tensors, integer/bool/complex tensors
    and sparse layouts. Any shape is accepted and flattened.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidTensorError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise InvalidTensorError(f"{name} must have a floating dtype ({allowed}), got {tensor.dtype}")
    return tensor.reshape(-1)
