"""Cost model: the traffic of every collective and exchange."""

import numpy as np
import pytest

from gradsift.exchanges.costmodel import (
    Traffic,
    all_to_all,
    allgather_traffic,
    binomial_broadcast,
    dense_allreduce_traffic,
    powersgd_traffic,
    ring_allgather,
    ring_allreduce,
    shared_mask_traffic,
    sparse_reduce_scatter_traffic,
)


def _fields(traffic: Traffic) -> tuple[float, float, float]:
    return (float(traffic.received_bytes), float(traffic.path_bytes), float(traffic.hops))


def test_collectives_on_hand_computed_values():
    assert _fields(ring_allreduce(1e8, 4)) == pytest.approx((1.5e8, 1.5e8, 6))  # 2 * 3/4 * S, 2 (P-1)
    assert _fields(ring_allgather(1e6, 4)) == pytest.approx((3e6, 3e6, 3))
    assert _fields(all_to_all(5e5, 4)) == pytest.approx((5e5, 5e5, 1))
    assert _fields(binomial_broadcast(1e6, 5)) == pytest.approx((1e6, 3e6, 3))  # ceil(log2 5) = 3 rounds
    assert _fields(binomial_broadcast(1e6, 1)) == (0.0, 0.0, 0.0)
    assert (ring_allreduce(1e6, 2) + ring_allgather(1e3, 2)).seconds(1e6, 1e-3) == pytest.approx(
        1.001 + 0.003
    )


def test_exchanges_on_hand_computed_values():
    # n = 1e6 fp32 values on 8 workers: 2 * 7/8 * 4e6 bytes, 14 latencies.
    assert _fields(dense_allreduce_traffic(1e6, 8)) == pytest.approx((7e6, 7e6, 14))
    # k = 1e4 entries of 8 bytes and an 8-byte header from each of the 7 others.
    assert _fields(allgather_traffic(1e4, 8)) == pytest.approx((7 * (8e4 + 8),) * 2 + (14,))
    # counts 4*7 + entries 7/8 * 1e4 * 8 + header 7*8 + slices 7 * 1250 * 8; 1 + 1 + 7 + 7 latencies.
    balanced = 28 + 70_000 + 56 + 70_000
    assert _fields(sparse_reduce_scatter_traffic(1e4, 8)) == pytest.approx((balanced, balanced, 16))
    # load 2 and kept 2: the 4 k (P-1)/P entries bound (plus the 84 bytes of counts and headers).
    assert float(sparse_reduce_scatter_traffic(1e4, 8, load=2, kept=2).received_bytes) == pytest.approx(
        4 * 1e4 * 7 / 8 * 8 + 84
    )
    # An 8-byte header and 4e4 index bytes, each broadcast in ceil(log2 8) = 3 rounds, then
    # 2 * 7/8 * 4e4 value bytes.
    assert _fields(shared_mask_traffic(1e4, 8)) == pytest.approx((8 + 4e4 + 7e4, 3 * (8 + 4e4) + 7e4, 6 + 14))
    assert _fields(shared_mask_traffic(1e4, 8, index_bytes=0, header_bytes=0)) == pytest.approx(
        (7e4, 7e4, 20)
    )
    # rows 120 and cols 80 at rank 2 (960 and 640 bytes) and 10 dense values, each * 2 * 3/4.
    powersgd = powersgd_traffic([(100, 50), (20, 30)], 2, 4, vector_numel=10)
    assert _fields(powersgd) == pytest.approx((2460, 2460, 18))
    assert shared_mask_traffic(1e4, 8, header_bytes=0).seconds(1e6, 1e-3) == pytest.approx(0.19 + 0.020)


def test_traffic_of_an_array_of_worker_counts_matches_each_count():
    workers = np.array([2, 3, 64, 1000])
    together = sparse_reduce_scatter_traffic(1e4, workers, load=1.5) + shared_mask_traffic(1e4, workers)
    for i, p in enumerate(workers.tolist()):
        alone = sparse_reduce_scatter_traffic(1e4, p, load=1.5) + shared_mask_traffic(1e4, p)
        assert together.path_bytes[i] == pytest.approx(alone.path_bytes)
        assert together.hops[i] == pytest.approx(alone.hops)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ring_allgather(1e3, np.array([2.0, 4.0])), "workers must be integers"),
        (lambda: sparse_reduce_scatter_traffic(1e3, 4, load=0.5), "load"),
        (lambda: powersgd_traffic([(3, 0)], 1, 4), "cols"),
    ],
)
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call()
