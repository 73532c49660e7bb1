"""``exchange="auto"``: the cost model's pick per bucket, the same on every rank."""

import pytest

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges import AUTO_LINK
from gradsift.exchanges.choice import choose_exchange, exchange_class, resolve_exchange

#: ``AUTO_LINK`` as documented: 10 Gbit/s in bytes per second, 50 us per message.
BANDWIDTH, LATENCY = 10e9 / 8, 50e-6


def test_the_auto_link_is_the_documented_one():
    assert AUTO_LINK == (BANDWIDTH, LATENCY)


def predicted_seconds(k: int, w: int) -> dict[str, float]:
    """Each exact sparse exchange's time for ``k`` entries on ``w`` workers, from the
    collectives as gloo runs them (docs/decisions.md, "The cost model counts ..."): a ring
    allgather of ``m`` bytes puts ``(w-1) m`` on the critical path in ``w-1`` messages;
    entries of 8 bytes (value and index), an 8-byte header. Time: path bytes / bandwidth +
    messages x latency. (The balanced reduce-scatter and the shared mask are not exact:
    ``"auto"`` does not consider them.)"""
    allgather = ((w - 1) * 8 + (w - 1) * 8 * k, 2 * (w - 1))  # header, then the entries
    times = {"allgather": allgather}
    return {name: path / BANDWIDTH + messages * LATENCY for name, (path, messages) in times.items()}


@pytest.mark.parametrize(
    ("numel", "world", "expected"),
    [
        (10_000_000, 2, "allgather"),
        (10_000_000, 16, "allgather"),  # bandwidth-bound: the flat exchanges would be faster
        (1_000, 16, "allgather"),
        (10_000_000, 64, "allgather"),
    ],
)
def test_auto_takes_the_exact_exchange_predicted_fastest(numel, world, expected):
    """The pick is the fastest of :func:`predicted_seconds` (written from the collectives'
    costs, not with gradsift.exchanges.costmodel) for ``k = floor(ratio n)``."""
    sidco = gradsift.get_compressor("sidco-exp", ratio=0.01)
    predicted = predicted_seconds(numel // 100, world)
    assert min(predicted, key=predicted.get) == expected
    assert choose_exchange(sidco, numel, world) == expected


#: The exchanges that deliver an approximation of the mean (docs/choosing.md).
APPROXIMATE = {"balanced", "shared-mask"}


@pytest.mark.parametrize("name", ["sidco-exp", "topk", "dgc", "gaussiank"])
def test_auto_never_picks_an_approximate_exchange(name):
    """At 2..1024 workers and buckets of 10 to 10^8 elements, ``"auto"`` never picks
    balanced or shared-mask, though the compressor supports both."""
    compressor = gradsift.get_compressor(name, ratio=0.01)
    assert set(compressor.exchanges) >= APPROXIMATE
    for world in [2, 3, 4, 8, 16, 64, 256, 1024]:
        for numel in [10, 1_000, 100_000, 10_000_000, 100_000_000]:
            assert choose_exchange(compressor, numel, world) not in APPROXIMATE, (world, numel)
    assert resolve_exchange(compressor).name not in APPROXIMATE


def test_the_approximate_exchanges_stay_available_by_name():
    sidco = gradsift.get_compressor("sidco-exp", ratio=0.01)
    assert [resolve_exchange(sidco, name).name for name in ["balanced", "shared-mask"]] == [
        "balanced",
        "shared-mask",
    ]
    assert not exchange_class("balanced").exact and not exchange_class("shared-mask").exact
    assert all(exchange_class(name).exact for name in ["allgather", "allreduce", "delegated"])


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
    assert resolve_exchange(compressor).name == exchange


def test_an_unsupported_exchange_is_refused_with_what_is_supported():
    with pytest.raises(
        InvalidOptionError, match="'qsgd' cannot travel by exchange 'balanced'; it supports: allgather"
    ):
        resolve_exchange(gradsift.get_compressor("qsgd"), "balanced")
