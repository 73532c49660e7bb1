"""``exchange="auto"``: the cost model's pick per bucket, the same on every rank."""

import pytest

import gradsift
from gradsift import costmodel
from gradsift.compressors.base import target_count
from gradsift.errors import InvalidOptionError
from gradsift.exchanges import AUTO_LINK, choose_exchange, exchange_for


def test_auto_takes_the_allgather_on_two_workers_and_a_flat_exchange_at_scale():
    sidco = gradsift.get_compressor("sidco-exp", ratio=0.01)
    assert choose_exchange(sidco, 10_000_000, 2) == "allgather"  # fewest rounds, same bytes
    assert choose_exchange(sidco, 10_000_000, 16) == "balanced"
    assert choose_exchange(sidco, 1_000, 16) == "allgather"  # latency-bound: a few rounds win
    # the pick is the argmin of the cost model's predictions on AUTO_LINK
    k = target_count(10_000_000, 0.01)
    predicted = {
        "allgather": costmodel.allgather_traffic(k, 16).seconds(*AUTO_LINK),
        "balanced": costmodel.sparse_reduce_scatter_traffic(k, 16).seconds(*AUTO_LINK),
        "shared-mask": costmodel.shared_mask_traffic(k, 16).seconds(*AUTO_LINK),
    }
    assert min(predicted, key=predicted.get) == "balanced"


@pytest.mark.parametrize(
    ("name", "exchange"),
    [
        ("bf16", "allreduce"),
        ("randomk", "allreduce"),
        ("qsgd", "allgather"),
        ("vgc", "allgather"),
        ("powersgd", "delegated"),
    ],
)
def test_auto_keeps_the_only_exchange_of_a_method(name, exchange):
    compressor = gradsift.get_compressor(name)
    assert choose_exchange(compressor, 10_000_000, 64) == exchange
    assert exchange_for(compressor).name == exchange


def test_an_unsupported_exchange_is_refused_with_what_is_supported():
    with pytest.raises(
        InvalidOptionError, match="'qsgd' cannot travel by exchange 'balanced'; it supports: allgather"
    ):
        exchange_for(gradsift.get_compressor("qsgd"), "balanced")
