"""Step-time predictions and crossover worker counts from the exchanges' traffic."""

import itertools
import math

import numpy as np
import pytest

from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges.costmodel import (
    allgather_traffic,
    dense_allreduce_traffic,
    ring_allgather,
    ring_allreduce,
    shared_mask_traffic,
    sparse_reduce_scatter_traffic,
)
from gradsift.tools.predictions import (
    allgather_crossover_workers,
    allgather_seconds,
    crossover_workers,
    predict_step_time,
    ring_allreduce_seconds,
)


def test_crossovers_against_dense_fp32_at_one_percent():
    n, k = 1e6, 1e4
    dense = lambda p: dense_allreduce_traffic(n, p)  # noqa: E731
    # (P-1) (8k + 8) < 2 (P-1)/P 4n  <=>  P < 8n / (8k + 8) = 99.99: the allgather pays up to 99
    # workers, at any bandwidth and latency (both exchanges take 2 (P-1) latencies).
    for bandwidth, latency in [(1.25e8, 0.0), (1.25e10, 1e-4)]:
        got = crossover_workers(
            lambda p: allgather_traffic(k, p), dense, bandwidth=bandwidth, latency=latency
        )
        assert got == 100
    # The flat exchanges still pay at 2**20 workers (25.6M parameters, 10 us per message).
    for bandwidth in (1.25e8, 1.25e9, 1.25e10):
        for flat in (sparse_reduce_scatter_traffic, shared_mask_traffic):
            exchange = lambda p, flat=flat: flat(0.01 * 25.6e6, p)  # noqa: E731
            baseline = lambda p: dense_allreduce_traffic(25.6e6, p)  # noqa: E731
            assert crossover_workers(exchange, baseline, bandwidth=bandwidth, latency=1e-5) is None
    # A "mask" of every element costs the dense allreduce plus the broadcast: it never pays.
    assert crossover_workers(lambda p: shared_mask_traffic(n, p), dense, bandwidth=1e9, limit=1000) == 2


def test_formulas_on_hand_computed_values():
    # 100 MB model, 1 GB/s, 4 workers: 2 * 3/4 * 0.1 s + 2 * 3 * 1 ms.
    assert ring_allreduce_seconds(1e8, 4, 1e9, 1e-3) == pytest.approx(0.15 + 0.006)
    # 1 MB messages: 3 * (1 ms + 1 ms).
    assert allgather_seconds(1e6, 4, 1e9, 1e-3) == pytest.approx(0.006)
    assert ring_allreduce_seconds(1e8, 1, 1e9, 1e-3) == 0.0
    p = predict_step_time(
        model_nbytes=1e8,
        message_nbytes=1e6,
        workers=4,
        bandwidth=1e9,
        latency=1e-3,
        compute_seconds=0.2,
        compress_seconds=0.01,
    )
    assert p.dense == pytest.approx(0.356)
    assert p.sparse == pytest.approx(0.216)
    assert p.speedup == pytest.approx(0.356 / 0.216)


def _first_n_from_which_sparse_never_pays(model, message, bw, latency, compress, limit=10**5):
    """Brute force over N (numpy) with the formulas written out independently; None if it pays at the limit."""
    n = np.arange(2, limit + 1, dtype=np.float64)
    dense = 2 * (n - 1) / n * model / bw + 2 * (n - 1) * latency
    pays = compress + (n - 1) * (message / bw + latency) < dense
    if pays[-1]:
        return None
    paying = np.nonzero(pays)[0]
    return 2 if paying.size == 0 else int(n[paying[-1]]) + 1


@pytest.mark.parametrize(
    ("model", "message", "latency", "compress"),
    # message sizes that do not divide 2 * model: no exact tie between the two times, whose
    # float rounding would decide the answer
    list(itertools.product([1e6, 1e8], [1.1e4, 1.1e5, 4.3e5], [0.0, 1e-5], [0.0, 1e-3, 0.05])),
)
def test_crossover_matches_brute_force(model, message, latency, compress):
    bw = 1.25e9  # 10 Gbit/s
    expected = _first_n_from_which_sparse_never_pays(model, message, bw, latency, compress)
    got = allgather_crossover_workers(
        model_nbytes=model, message_nbytes=message, bandwidth=bw, latency=latency, compress_seconds=compress
    )
    assert got == expected
    scanned = crossover_workers(lambda p: ring_allgather(message, p), lambda p: ring_allreduce(model, p),
                                bandwidth=bw, latency=latency, compress_seconds=compress, limit=10**5)  # fmt: skip
    assert scanned == expected


def test_crossover_example_and_latency_dominated_cases():
    # 1 % density of a 100 MB model with 4-byte VGC words: m = 1 MB. Without latency and
    # compression time sparse is faster while (N-1) m < 2 (N-1)/N S, i.e. N < 2 S/m = 250.
    assert allgather_crossover_workers(model_nbytes=1.25e8, message_nbytes=1e6, bandwidth=1e9) == 250
    # A message cheaper than the latency it saves: sparse never stops paying.
    assert (
        allgather_crossover_workers(model_nbytes=1e8, message_nbytes=1e3, bandwidth=1e9, latency=1e-3) is None
    )
    # m/bw == L exactly and compression costs more than the dense transfer: never pays.
    assert (
        allgather_crossover_workers(
            model_nbytes=1e3, message_nbytes=1e6, bandwidth=1e9, latency=1e-3, compress_seconds=1.0
        )
        == 2
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ring_allreduce_seconds(1e6, 0, 1e9), "workers"),
        (lambda: ring_allreduce_seconds(1e6, 2.5, 1e9), "workers"),
        (lambda: allgather_seconds(1e6, 4, 0.0), "bandwidth"),
        (lambda: allgather_seconds(-1, 4, 1e9), "nbytes"),
        (lambda: allgather_seconds(1e6, 4, 1e9, latency=math.nan), "latency"),
        (
            lambda: predict_step_time(
                model_nbytes=1, message_nbytes=1, workers=2, bandwidth=1, compute_seconds=-1
            ),
            "compute_seconds",
        ),
        (
            lambda: allgather_crossover_workers(model_nbytes=1, message_nbytes=-1, bandwidth=1),
            "message_nbytes",
        ),
        (
            lambda: crossover_workers(
                lambda p: ring_allgather(1, p), lambda p: ring_allreduce(1, p), bandwidth=0
            ),
            "bandwidth",
        ),
    ],
)
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("model_nbytes", "message"),
    [
        ("1e8", r"^model_nbytes must be a real number, got '1e8'"),
        (True, "^model_nbytes must be a real number, got True"),
        (-1.0, r"^model_nbytes must lie in \[0.0, inf\), got -1.0"),
        (math.nan, "^model_nbytes must be a number, got NaN"),
        (math.inf, "^model_nbytes must be finite, got inf"),
    ],
)
def test_allgather_crossover_refuses_a_model_size_that_is_not_a_size(model_nbytes, message):
    # A message cheaper than its latency (a < 0): the closed form answers without computing
    # an allreduce time, so only the function's own check of model_nbytes can refuse it.
    assert (
        allgather_crossover_workers(model_nbytes=1e8, message_nbytes=1e3, bandwidth=1e9, latency=1e-3) is None
    )
    with pytest.raises(InvalidOptionError, match=message):
        allgather_crossover_workers(
            model_nbytes=model_nbytes, message_nbytes=1e3, bandwidth=1e9, latency=1e-3
        )


@pytest.mark.parametrize("argument", ["message_nbytes", "bandwidth", "latency", "compress_seconds"])
def test_allgather_crossover_refuses_an_infinite_argument(argument):
    """check_real promises a finite float: inf is refused by name, not a bare ValueError later."""
    arguments = {"model_nbytes": 1e8, "message_nbytes": 1e6, "bandwidth": 1e9, "latency": 1e-4}
    with pytest.raises(InvalidOptionError, match=f"^{argument} must be finite, got inf"):
        allgather_crossover_workers(**{**arguments, argument: math.inf})
