"""``exchange="auto"``: the cost model's pick per bucket, the same on every rank."""

import math

import pytest

import gradsift
from gradsift.errors import InvalidOptionError
from gradsift.exchanges import AUTO_LINK, choose_exchange, exchange_for

#: ``AUTO_LINK`` as documented: 10 Gbit/s in bytes per second, 50 us per message.
BANDWIDTH, LATENCY = 10e9 / 8, 50e-6


def test_the_auto_link_is_the_documented_one():
    assert AUTO_LINK == (BANDWIDTH, LATENCY)


def predicted_seconds(k: int, w: int) -> dict[str, float]:
    """Each sparse exchange's time for ``k`` entries on ``w`` workers, from the collectives
    as gloo runs them (docs/decisions.md, "The cost model counts ..."): a ring allgather of
    ``m`` bytes puts ``(w-1) m`` on the critical path in ``w-1`` messages, a ring allreduce
    of ``S`` bytes ``2 (w-1)/w S`` in ``2 (w-1)``, an all_to_all what the worker receives in
    one, a binomial broadcast ``ceil(log2 w)`` times the message in as many; entries of 8
    bytes (value and index), 4-byte counts, an 8-byte header. Time: path bytes / bandwidth
    + messages x latency."""
    rounds = math.ceil(math.log2(w))
    allgather = ((w - 1) * 8 + (w - 1) * 8 * k, 2 * (w - 1))  # header, then the entries
    balanced = (  # counts, entries by slice, header, re-sparsified slices
        4 * (w - 1) + (w - 1) / w * 8 * k + (w - 1) * 8 + (w - 1) * 8 * k / w,
        1 + 1 + (w - 1) + (w - 1),
    )
    shared_mask = (rounds * 8 + rounds * 4 * k + 2 * (w - 1) / w * 4 * k, 2 * rounds + 2 * (w - 1))
    times = {"allgather": allgather, "balanced": balanced, "shared-mask": shared_mask}
    return {name: path / BANDWIDTH + messages * LATENCY for name, (path, messages) in times.items()}


@pytest.mark.parametrize(
    ("numel", "world", "expected"),
    [
        (10_000_000, 2, "allgather"),  # fewest rounds, about the same bytes
        (10_000_000, 16, "balanced"),  # bandwidth-bound: the flat exchange
        (1_000, 16, "allgather"),  # latency-bound: a few rounds win
        (10_000_000, 64, "balanced"),
    ],
)
def test_auto_takes_the_exchange_predicted_fastest(numel, world, expected):
    """The pick is the fastest of :func:`predicted_seconds` (written from the collectives'
    costs, not with gradsift.costmodel) for ``k = floor(ratio n)``, and is what the
    comments say."""
    sidco = gradsift.get_compressor("sidco-exp", ratio=0.01)
    predicted = predicted_seconds(numel // 100, world)
    assert min(predicted, key=predicted.get) == expected
    assert choose_exchange(sidco, numel, world) == expected


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
