"""Cost model: ring allreduce vs sparse allgather step times and their crossover."""

import itertools
import math

import numpy as np
import pytest

from gradsift.costmodel import (
    allgather_crossover_workers,
    allgather_seconds,
    predict_step_time,
    ring_allreduce_seconds,
)


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
    list(itertools.product([1e6, 1e8], [1e4, 1e5, 4e5], [0.0, 1e-5], [0.0, 1e-3, 0.05])),
)
def test_crossover_matches_brute_force(model, message, latency, compress):
    bw = 1.25e9  # 10 Gbit/s
    expected = _first_n_from_which_sparse_never_pays(model, message, bw, latency, compress)
    got = allgather_crossover_workers(
        model_nbytes=model, message_nbytes=message, bandwidth=bw, latency=latency, compress_seconds=compress
    )
    assert got == expected


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
    ],
)
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call()
