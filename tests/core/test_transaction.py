"""The step's lifecycle outside the hook: a Transaction settled by one host read, then a commit,
or a roll back when its flag holds; a compressor's public compress ends this way, and a
compress whose encode raises leaves no transaction open."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsift import get_compressor
from gradsift.core.store import TensorStore
from gradsift.core.transaction import Transaction


class Counter:
    """A participant with one host number, snapshot and restored."""

    def __init__(self) -> None:
        self.value = 0

    def snapshot(self) -> dict[str, Any]:
        return {"value": self.value}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.value = snapshot["value"]


@pytest.mark.parametrize("flag", [None, False, True])
def test_settle_reads_once_then_commits_or_rolls_back(flag):
    store, counter, updates = TensorStore(), Counter(), []
    transaction = Transaction(store, counter)
    store.put("residual", 0, torch.ones(3))
    counter.value = 1
    transaction.readout.after_commit(lambda: updates.append("ran"))
    dropped = None if flag is None else transaction.readout.slot(torch.tensor(flag))
    kept = transaction.settle(dropped)
    assert kept is not flag
    assert not store.in_transaction
    assert (store.get("residual", 0) is not None) is kept
    assert counter.value == int(kept)
    assert updates == (["ran"] if kept else [])


def test_settle_leaves_a_store_transaction_it_joined_to_its_owner():
    store = TensorStore()
    store.begin()
    Transaction(store, Counter()).settle()
    assert store.in_transaction


def test_compress_whose_encode_raises_rolls_its_transaction_back(monkeypatch):
    compressor = get_compressor("randomk", ratio=0.1)
    compressor.compress(torch.randn(100))

    def broken(*args: Any, **kwargs: Any) -> None:
        compressor.steps[0] = 99  # a host update the failed step must not keep
        raise RuntimeError("encode failed")

    monkeypatch.setattr(compressor, "encode", broken)
    with pytest.raises(RuntimeError, match="encode failed"):
        compressor.compress(torch.randn(100))
    assert not compressor.store.in_transaction
    assert compressor.steps == {0: 1}
