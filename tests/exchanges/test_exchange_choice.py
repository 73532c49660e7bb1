"""``exchange="auto"``: the compressor's first exact exchange, never an approximate one."""

import pytest

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges.choice import exchange_class, resolve_exchange

#: The exchanges that deliver an approximation of the mean (docs/choosing.md).
APPROXIMATE = {"balanced", "shared-mask"}


@pytest.mark.parametrize("name", ["sidco-exp", "topk", "dgc", "gaussiank"])
def test_auto_never_picks_an_approximate_exchange(name):
    """``"auto"`` never takes balanced or shared-mask, though the compressor supports both."""
    compressor = gradsift.get_compressor(name, ratio=0.01)
    assert set(compressor.exchanges) >= APPROXIMATE
    assert resolve_exchange(compressor).name == "allgather"


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
    assert resolve_exchange(compressor).name == exchange


def test_an_unsupported_exchange_is_refused_with_what_is_supported():
    with pytest.raises(
        InvalidOptionError, match="'qsgd' cannot travel by exchange 'balanced'; it supports: allgather"
    ):
        resolve_exchange(gradsift.get_compressor("qsgd"), "balanced")
