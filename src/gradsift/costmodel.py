"""When does sparse allgather pay? Step-time predictions for dense vs compressed exchange.

Symbols (SI units: bytes, bytes per second, seconds):
    ``S`` bytes of the dense gradient (the model), ``m`` bytes of one worker's
    compressed message, ``N`` workers, ``bw`` link bandwidth, ``L`` per-message latency,
    ``T_c`` compute time of one step (forward + backward), ``T_s`` time to compress and
    decompress (selection, encoding, decoding, scatter).

Communication (ring algorithms, no overlap with compute):
    dense ring allreduce  ``T_ar(N) = 2 (N-1)/N * S / bw + 2 (N-1) L``
    sparse ring allgather ``T_ag(N) = (N-1) * m / bw + (N-1) L``

Step time:
    dense  ``T_dense  = T_c + T_ar(N)``
    sparse ``T_sparse = T_c + T_s + T_ag(N)``

The allreduce's bytes per worker are bounded (``< 2 S``) while the allgather's grow
linearly with ``N``, so beyond some worker count the compressed exchange stops paying:
:func:`allgather_crossover_workers` returns it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsift.errors import InvalidOptionError
from gradsift.validation import check_int, check_real


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
    """``2 (N-1)/N * S / bw + 2 (N-1) L``: reduce-scatter then allgather of ``N`` chunks."""
    nbytes, workers, bandwidth, latency = _checked(nbytes, workers, bandwidth, latency)
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * latency


def allgather_seconds(message_nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
    """``(N-1) * m / bw + (N-1) L``: every worker receives the other ``N-1`` messages."""
    message_nbytes, workers, bandwidth, latency = _checked(message_nbytes, workers, bandwidth, latency)
    return (workers - 1) * (message_nbytes / bandwidth + latency)


@dataclass(frozen=True)
class StepTimePrediction:
    """Predicted seconds per step; ``speedup = dense / sparse`` (> 1: compression pays)."""

    dense: float
    sparse: float

    @property
    def speedup(self) -> float:
        return self.dense / self.sparse if self.sparse > 0 else math.inf


def predict_step_time(
    *,
    model_nbytes: float,
    message_nbytes: float,
    workers: int,
    bandwidth: float,
    latency: float = 0.0,
    compute_seconds: float = 0.0,
    compress_seconds: float = 0.0,
) -> StepTimePrediction:
    """``T_dense = T_c + T_ar(N)`` and ``T_sparse = T_c + T_s + T_ag(N)`` (module docstring)."""
    compute_seconds = check_real(compute_seconds, "compute_seconds", low=0.0)
    compress_seconds = check_real(compress_seconds, "compress_seconds", low=0.0)
    return StepTimePrediction(
        dense=compute_seconds + ring_allreduce_seconds(model_nbytes, workers, bandwidth, latency),
        sparse=compute_seconds
        + compress_seconds
        + allgather_seconds(message_nbytes, workers, bandwidth, latency),
    )


def allgather_crossover_workers(
    *,
    model_nbytes: float,
    message_nbytes: float,
    bandwidth: float,
    latency: float = 0.0,
    compress_seconds: float = 0.0,
) -> int | None:
    """Smallest ``N >= 2`` from which on the sparse allgather is never faster than the allreduce.

    ``T_sparse(N) >= T_dense(N)`` is, after multiplying by ``N``, the quadratic
    ``g(N) = a N^2 - (a + b - c) N + b >= 0`` with ``a = m/bw - L``, ``b = 2 S / bw`` and
    ``c = T_s``. For ``a > 0`` it holds for every ``N`` at or above the larger root
    (the answer is its ceiling, at least 2; 2 also when compression never pays). For
    ``a <= 0`` a message costs no more than the latency it saves, and sparse stays
    cheaper for every ``N`` once it is: the answer is None (it never stops paying), or
    2 when it never pays at all (``a = 0`` and ``c >= b``). The compute time cancels out.
    """
    model_nbytes, _, bandwidth, latency = _checked(model_nbytes, 2, bandwidth, latency)
    message_nbytes = check_real(message_nbytes, "message_nbytes", low=0.0)
    compress_seconds = check_real(compress_seconds, "compress_seconds", low=0.0)
    a = message_nbytes / bandwidth - latency
    b = 2 * model_nbytes / bandwidth
    c = compress_seconds

    def stops_paying(n: int) -> bool:  # g(n) >= 0, evaluated as predicted times
        dense = ring_allreduce_seconds(model_nbytes, n, bandwidth, latency)
        return c + allgather_seconds(message_nbytes, n, bandwidth, latency) >= dense

    if a <= 0:
        # g is concave (a < 0, so it ends negative) or linear with slope c - b: once
        # negative it stays negative.
        return None if a < 0 or b > c else 2
    discriminant = (a + b - c) ** 2 - 4 * a * b
    if discriminant <= 0:
        return 2  # g >= 0 everywhere: the allgather never pays
    n = max(2, math.ceil(((a + b - c) + math.sqrt(discriminant)) / (2 * a)))
    # Guard the float root: step to the exact integer boundary.
    while n > 2 and stops_paying(n - 1):
        n -= 1
    while not stops_paying(n):
        n += 1
    return n


def _checked(
    nbytes: object, workers: object, bandwidth: object, latency: object
) -> tuple[float, int, float, float]:
    if isinstance(workers, int) and not isinstance(workers, bool) and workers < 1:
        raise InvalidOptionError(f"workers must be an integer >= 1, got {workers}")
    return (
        check_real(nbytes, "nbytes", low=0.0),
        check_int(workers, "workers", low=1),
        check_real(bandwidth, "bandwidth", low=0.0, low_open=True),
        check_real(latency, "latency", low=0.0),
    )
