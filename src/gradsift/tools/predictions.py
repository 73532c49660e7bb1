"""When does compression pay? Step times and crossover worker counts from the exchanges' costs.

Symbols as in :mod:`gradsift.exchanges.costmodel` (its :class:`~gradsift.exchanges.costmodel.Traffic`
per worker: ``C`` bytes on the critical path, ``H`` message latencies), plus ``T_c`` the
compute time of one step (forward + backward) and ``T_s`` the time to compress and
decompress. Step time (no overlap with compute): ``T = T_c + T_s + C / bw + H L``.

Against fp32 (``b = 4``) with 8-byte entries, the allgather's ``(P-1) 8 k`` bytes stay
below the dense allreduce's ``2 (P-1)/P 4 n`` only while ``P < n/k = 1/delta`` -- 100
workers at 1 % (the latencies cancel: both take 2 (P-1) of them, and the header is
negligible). :func:`crossover_workers` finds the worker count from which an exchange
stops paying against another (:func:`allgather_crossover_workers` for the allgather in
closed form). The report (:mod:`gradsift.tools.report`) and the benchmarks read these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradsift.core.validation import check_int, check_real
from gradsift.exchanges.costmodel import Traffic, ring_allgather, ring_allreduce

CROSSOVER_LIMIT = 2**20


def crossover_workers(
    exchange: Callable[[np.ndarray], Traffic],
    baseline: Callable[[np.ndarray], Traffic],
    *,
    bandwidth: float,
    latency: float = 0.0,
    compress_seconds: float = 0.0,
    limit: int = CROSSOVER_LIMIT,
) -> int | None:
    """Smallest ``P >= 2`` from which on ``exchange`` (plus ``T_s``) is never faster than
    ``baseline``, checked for every ``P`` up to ``limit``; None when it still pays at ``limit``.

    ``exchange`` and ``baseline`` map an array of worker counts to their :class:`Traffic`.
    The compute time is common to both and cancels out.
    """
    compress_seconds = check_real(compress_seconds, "compress_seconds", low=0.0)
    limit = check_int(limit, "limit", low=2)
    workers = np.arange(2, limit + 1)
    mine = exchange(workers).seconds(bandwidth, latency) + compress_seconds
    pays = np.asarray(mine < baseline(workers).seconds(bandwidth, latency))
    if pays[-1]:
        return None
    paying = np.nonzero(pays)[0]
    return 2 if paying.size == 0 else int(workers[paying[-1]]) + 1


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
    """``2 (N-1)/N * S / bw + 2 (N-1) L``: reduce-scatter then allgather of ``N`` chunks."""
    return float(ring_allreduce(nbytes, workers).seconds(bandwidth, latency))


def allgather_seconds(message_nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
    """``(N-1) * m / bw + (N-1) L``: every worker receives the other ``N-1`` messages."""
    return float(ring_allgather(message_nbytes, workers).seconds(bandwidth, latency))


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
    """``T_dense = T_c + T_ar(N)`` and ``T_sparse = T_c + T_s + T_ag(N)`` with one ring
    allreduce of the model and one ring allgather of the message."""
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
    """Smallest ``N >= 2`` from which on one sparse allgather is never faster than the
    allreduce (closed form of :func:`crossover_workers` for this pair, no limit).

    ``T_sparse(N) >= T_dense(N)`` is, after multiplying by ``N``, the quadratic
    ``g(N) = a N^2 - (a + b - c) N + b >= 0`` with ``a = m/bw - L``, ``b = 2 S / bw`` and
    ``c = T_s``. For ``a > 0`` it holds for every ``N`` at or above the larger root
    (the answer is its ceiling, at least 2; 2 also when compression never pays). For
    ``a <= 0`` a message costs no more than the latency it saves, and sparse stays
    cheaper for every ``N`` once it is: the answer is None (it never stops paying), or
    2 when it never pays at all (``a = 0`` and ``c >= b``). The compute time cancels out.
    """
    model_nbytes = check_real(model_nbytes, "model_nbytes", low=0.0)
    bandwidth = check_real(bandwidth, "bandwidth", low=0.0, low_open=True)
    latency = check_real(latency, "latency", low=0.0)
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
