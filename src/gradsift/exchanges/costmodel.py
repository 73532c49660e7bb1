"""The communication cost of every exchange: bytes and message latencies per worker.

Symbols (SI units: bytes, bytes per second, seconds): ``n`` gradient elements, ``b``
bytes per dense value (4 fp32, 2 bf16), ``P`` workers, ``k = delta n`` entries a
worker selects, ``e = b_v + b_i`` bytes per sparse entry (fp32 value + int32 index:
8), ``bw`` link bandwidth, ``L`` latency per message.

Every host has its own full-duplex link of rate ``bw`` to a switch (what
:mod:`gradsift.tools.train.netem` emulates). A collective is described by its :class:`Traffic`
per worker: ``R`` bytes the worker receives (what its NIC counts), ``C`` bytes that
cross one link one after the other on the critical path, and ``H`` message latencies
on it; its time is ``C / bw + H L``. The collectives, as gloo implements them:

    ring allreduce of S bytes    R = C = 2 (P-1)/P S        H = 2 (P-1)
    ring allgather of m bytes    R = C = (P-1) m            H = P - 1
    all_to_all, r bytes in       R = C = r                  H = 1   (all pairs at once)
    binomial broadcast of m      R = m, C = ceil(log2 P) m  H = ceil(log2 P)

The exchanges (one step's bucket, per worker), built from them:

    dense allreduce              R = 2 (P-1)/P n b                        H = 2 (P-1)
    allgather (sparse, variable) R = (P-1) (k e + h)                      H = 2 (P-1)
        a header allgather (``h`` bytes: the field lengths) then the entries padded
        to the largest worker's k: every worker receives the other P-1 selections.
    sparse reduce-scatter + allgather (Ok-Topk style)
                                 R = (P-1)/P k e (lambda + kappa) + (P-1) (h + 4)   H = 2 + 2 (P-1)
        rank j owns the index slice [j n/P, (j+1) n/P); an all_to_all of counts, then
        of the entries falling in each slice (about k/P per destination; ``lambda >= 1``
        is the busiest slice's load over the mean); each rank sums its slice and
        re-sparsifies it to ``kappa k/P`` entries (``kappa = 1``: the result stays
        k-sparse); a header allgather and a ring allgather of the reduced slices.
        Between 2 k (P-1)/P entries (balanced, ``lambda = kappa = 1``) and
        4 k (P-1)/P (``lambda + kappa = 4``) -- flat in P.
    shared-mask allreduce (ScaleCom style)
                                 R = h + k b_i + 2 (P-1)/P k b_v,  C = ceil(log2 P) (h + k b_i) + 2 (P-1)/P k b_v
                                                                          H = 2 ceil(log2 P) + 2 (P-1)
        a cyclic leader's header (``h`` bytes: its part counts) and k indices broadcast,
        then a ring allreduce of the k values every worker reads at those positions
        (``b_i = 0``: a mask agreed without sending indices).
    delegated PowerSGD (rank r)  R = 2 (P-1)/P b (sum_i (rows_i + cols_i) r + v)  H = 3 * 2 (P-1)
        three ring allreduces per bucket: the ``v`` elements of 1-D tensors sent dense,
        the P factors (rows x r per matrix), the Q factors (cols x r).

The dense allreduce's bytes per worker are bounded (``< 2 n b``) while the allgather's grow
linearly with ``P``; the reduce-scatter and shared-mask exchanges receive ``O(k)`` bytes
whatever ``P`` (plus 4 bytes of counts per peer, and ``log2 P`` broadcast rounds on the
path). The step times these costs predict, and the worker count from which an exchange
stops paying, are :mod:`gradsift.tools.predictions`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradsift.core.errors import InvalidOptionError
from gradsift.core.validation import check_int, check_real

#: Workers as a Python int or a numpy integer array (every traffic formula accepts both).
Workers = int | np.ndarray
#: A size in bytes or a count as a Python real or a numpy array (every traffic formula accepts both).
Amount = float | np.ndarray


@dataclass(frozen=True)
class Traffic:
    """One worker's communication in a collective or an exchange.

    ``received_bytes``: bytes the worker receives (its NIC's count); ``path_bytes``:
    bytes serialized on one link along the critical path; ``hops``: message latencies
    on it. Fields are floats, or arrays when built for an array of worker counts.
    Phases that follow each other add up (``a + b``).
    """

    received_bytes: float | np.ndarray
    path_bytes: float | np.ndarray
    hops: float | np.ndarray

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.received_bytes + other.received_bytes,
            self.path_bytes + other.path_bytes,
            self.hops + other.hops,
        )

    def seconds(self, bandwidth: float, latency: float = 0.0) -> float | np.ndarray:
        """``C / bw + H L``."""
        bandwidth = check_real(bandwidth, "bandwidth", low=0.0, low_open=True)
        latency = check_real(latency, "latency", low=0.0)
        return self.path_bytes / bandwidth + self.hops * latency


def _workers(workers: object) -> Workers:
    """``workers`` checked: an integer >= 1, or a numpy integer array of them (as floats)."""
    if isinstance(workers, np.ndarray):
        if not np.issubdtype(workers.dtype, np.integer) or workers.size == 0 or workers.min() < 1:
            raise InvalidOptionError("workers must be integers >= 1")
        return workers.astype(np.float64)
    return check_int(workers, "workers", low=1)


def _bytes(value: object, name: str) -> float | np.ndarray:
    """A size (bytes or a count) checked: a real >= 0, or an array of them."""
    if isinstance(value, np.ndarray):
        if not np.all(np.isfinite(value)) or np.any(value < 0):
            raise InvalidOptionError(f"{name} must be finite numbers >= 0")
        return value.astype(np.float64)
    return check_real(value, name, low=0.0)


def _log2_ceil(workers: Workers) -> float | np.ndarray:
    return np.ceil(np.log2(workers)) if isinstance(workers, np.ndarray) else math.ceil(math.log2(workers))


# --- collectives -----------------------------------------------------------------------------


def ring_allreduce(nbytes: Amount, workers: Workers) -> Traffic:
    """Reduce-scatter then allgather of ``P`` chunks: ``R = C = 2 (P-1)/P S``, ``H = 2 (P-1)``."""
    nbytes, workers = _bytes(nbytes, "nbytes"), _workers(workers)
    moved = 2 * (workers - 1) / workers * nbytes
    return Traffic(moved, moved, 2 * (workers - 1))


def ring_allgather(message_nbytes: Amount, workers: Workers) -> Traffic:
    """Every worker receives the other ``P-1`` messages: ``R = C = (P-1) m``, ``H = P-1``."""
    message_nbytes, workers = _bytes(message_nbytes, "message_nbytes"), _workers(workers)
    return Traffic((workers - 1) * message_nbytes, (workers - 1) * message_nbytes, workers - 1)


def all_to_all(received_nbytes: Amount, workers: Workers) -> Traffic:
    """All pairs at once (gloo posts every send and receive together): ``R = C = r``, ``H = 1``."""
    _workers(workers)
    return Traffic(received_nbytes, received_nbytes, 1.0)


def binomial_broadcast(nbytes: Amount, workers: Workers) -> Traffic:
    """A binomial tree from the root: ``R = m``, ``C = H m`` with ``H = ceil(log2 P)`` rounds
    (the root sends the whole message once per round)."""
    nbytes, workers = _bytes(nbytes, "nbytes"), _workers(workers)
    rounds = _log2_ceil(workers)
    return Traffic(nbytes * (workers > 1), rounds * nbytes, rounds)


# --- exchanges -------------------------------------------------------------------------------


def dense_allreduce_traffic(numel: Amount, workers: Workers, *, value_bytes: Amount = 4) -> Traffic:
    """The dense exchange: one ring allreduce of ``n b`` bytes."""
    return ring_allreduce(_bytes(numel, "numel") * _bytes(value_bytes, "value_bytes"), workers)


def allgather_traffic(
    k: Amount, workers: Workers, *, entry_bytes: Amount = 8, header_bytes: Amount = 8
) -> Traffic:
    """The variable-size allgather: a header allgather, then the ``k`` entries (the
    largest worker's count: shorter messages are padded)."""
    entries = _bytes(k, "k") * _bytes(entry_bytes, "entry_bytes")
    return ring_allgather(_bytes(header_bytes, "header_bytes"), workers) + ring_allgather(entries, workers)


def sparse_reduce_scatter_traffic(
    k: Amount,
    workers: Workers,
    *,
    entry_bytes: Amount = 8,
    header_bytes: Amount = 8,
    load: float = 1.0,
    kept: float = 1.0,
) -> Traffic:
    """Ok-Topk-style balanced sparse allreduce: all_to_all of counts and of the entries
    per index slice (the busiest slice receives ``load (P-1)/P k`` entries), local sum,
    re-sparsification of the slice to ``kept k/P`` entries, allgather of the slices."""
    k, count = _bytes(k, "k"), _workers(workers)
    entry_bytes = _bytes(entry_bytes, "entry_bytes")
    load = check_real(load, "load", low=1.0)
    kept = check_real(kept, "kept", low=0.0)
    share = (count - 1) / count * k * entry_bytes
    counts = all_to_all(4 * (count - 1), workers)
    return (
        counts
        + all_to_all(load * share, workers)
        + ring_allgather(_bytes(header_bytes, "header_bytes"), workers)
        + ring_allgather(kept * k / count * entry_bytes, workers)
    )


def shared_mask_traffic(
    k: Amount, workers: Workers, *, value_bytes: Amount = 4, index_bytes: Amount = 4, header_bytes: Amount = 8
) -> Traffic:
    """ScaleCom-style shared mask: the leader's header (its part counts) and ``k`` indices
    broadcast, then a ring allreduce of the ``k`` values at those positions."""
    k = _bytes(k, "k")
    header = binomial_broadcast(_bytes(header_bytes, "header_bytes"), workers)
    indices = binomial_broadcast(k * _bytes(index_bytes, "index_bytes"), workers)
    return header + indices + ring_allreduce(k * _bytes(value_bytes, "value_bytes"), workers)


def powersgd_traffic(
    matrices: Sequence[tuple[int, int]],
    rank: int,
    workers: Workers,
    *,
    vector_numel: Amount = 0,
    value_bytes: Amount = 4,
) -> Traffic:
    """PowerSGD's three ring allreduces: the dense 1-D tensors, the P factors
    (``rows x rank`` per matrix) and the Q factors (``cols x rank``)."""
    rank = check_int(rank, "rank", low=1)
    value_bytes = _bytes(value_bytes, "value_bytes")
    rows = sum(check_int(r, "rows", low=1) for r, _ in matrices)
    cols = sum(check_int(c, "cols", low=1) for _, c in matrices)
    return (
        ring_allreduce(_bytes(vector_numel, "vector_numel") * value_bytes, workers)
        + ring_allreduce(rows * rank * value_bytes, workers)
        + ring_allreduce(cols * rank * value_bytes, workers)
    )
