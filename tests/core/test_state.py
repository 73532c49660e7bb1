"""The keyed state store: transactions, layouts that follow parameters, checkpoints."""

import pytest
import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.store import TensorStore

NUMELS = {0: 2, 1: 3, 2: 1}  # parameter number -> element count


def test_transaction_commits_or_leaves_no_trace():
    store = TensorStore()
    store.put("residual", "a", torch.tensor([1.0]))
    store.begin()
    store.put("residual", "a", torch.tensor([2.0]))
    store.put("residual", "b", torch.tensor([3.0]))
    store.discard("a")
    assert store.get("residual", "a") is None  # the transaction's view
    assert store.get("residual", "b").item() == 3.0
    assert store.table("residual").keys() == {"b"}
    store.rollback()
    assert store.get("residual", "a").item() == 1.0 and store.get("residual", "b") is None
    store.begin()
    store.put("residual", "b", torch.tensor([3.0]))
    store.discard("a")
    store.commit()
    assert store.table("residual").keys() == {"b"} and not store.in_transaction
    with pytest.raises(InvalidOptionError, match="already open"):
        store.begin()
        store.begin()


def test_an_in_place_change_waits_for_the_commit_and_a_rollback_forgets_it():
    store, seen = TensorStore(), []
    kept = torch.tensor([1.0])
    store.put("residual", "a", kept)
    store.on_commit(lambda: kept.add_(1.0))  # no transaction: at once
    assert kept.item() == 2.0
    for end in (store.rollback, store.commit):
        store.begin()
        store.put("velocity", "a", torch.tensor([5.0]))
        store.on_commit(lambda: seen.append(store.get("velocity", "a").item()))  # after the writes
        store.on_commit(lambda: kept.mul_(store.get("velocity", "a")))
        store.on_commit(lambda: seen.append(kept.item()))  # in order
        assert kept.item() == 2.0 and not seen
        end()
    assert seen == [5.0, 10.0] and kept.item() == 10.0  # the rolled-back changes never ran
    store.begin()
    store.on_commit(lambda: seen.append("cleared"))
    store.clear()
    store.commit()
    assert seen == [5.0, 10.0]


def test_discard_limited_to_tables_and_retain():
    store = TensorStore()
    store.put("residual", 1, torch.ones(1))
    store.put("vgc.variance", 1, torch.ones(1))
    store.put("residual", 2, torch.ones(1))
    store.discard(1, ["residual"])
    assert store.get("residual", 1) is None and store.get("vgc.variance", 1) is not None
    store.layouts[2] = (0,)
    store.retain({1})
    assert store.keys() == {1} and 2 not in store.layouts


def test_follow_permutes_per_element_tensors_and_keeps_scalars():
    store = TensorStore()
    key = (0, 1, 2)
    store.follow(key, (0, 1, 2), NUMELS)
    store.put("residual", key, torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0, 20.0]))  # 10 * param + element
    store.put("threshold", key, torch.tensor([9.0]))  # one number per key: cannot be cut
    store.follow(key, (2, 0, 1), NUMELS)
    assert store.get("residual", key).tolist() == [20.0, 0.0, 1.0, 10.0, 11.0, 12.0]
    assert store.get("threshold", key).tolist() == [9.0]
    store.follow(key, (2, 0, 1), NUMELS)  # same order: nothing moves
    assert store.get("residual", key).tolist() == [20.0, 0.0, 1.0, 10.0, 11.0, 12.0]


def test_follow_regroups_parameters_into_new_buckets_with_zeros_for_newcomers():
    store = TensorStore()
    store.follow((0, 1), (1, 0), NUMELS)
    store.put("residual", (0, 1), torch.tensor([10.0, 11.0, 12.0, 0.0, 1.0]))
    store.put("velocity", (0, 1), torch.tensor([-10.0, -11.0, -12.0, -0.0, -1.0]))
    # DDP rebuilt: parameter 0 alone, parameters 1 and 2 together (2 was never seen)
    store.follow(0, (0,), NUMELS)
    store.follow((1, 2), (2, 1), NUMELS)
    assert store.get("residual", 0).tolist() == [0.0, 1.0]
    assert store.get("residual", (1, 2)).tolist() == [0.0, 10.0, 11.0, 12.0]
    assert store.get("velocity", (1, 2)).tolist() == [0.0, -10.0, -11.0, -12.0]
    store.retain({0, (1, 2)})  # the old bucket's state is dropped once both took their parts
    assert store.keys() == {0, (1, 2)}


def test_zero_parameters_zeroes_their_chunks_in_every_per_element_table_and_nothing_else():
    store = TensorStore()
    store.follow((0, 1), (1, 0), NUMELS)  # parameter 1's three elements first
    store.put("residual", (0, 1), torch.tensor([10.0, 11.0, 12.0, 0.0, 1.0]))
    store.put("vgc.variance", (0, 1), torch.tensor([5.0, 5.0, 5.0, 6.0, 6.0]))
    store.put("threshold", (0, 1), torch.tensor([9.0]))  # per key: no parameter's chunk
    store.put("velocity", 2, torch.tensor([7.0]))  # a parameter's own key
    store.zero_parameters({1, 2}, NUMELS)
    assert store.get("residual", (0, 1)).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert store.get("vgc.variance", (0, 1)).tolist() == [0.0, 0.0, 0.0, 6.0, 6.0]
    assert store.get("threshold", (0, 1)).tolist() == [9.0]
    assert store.get("velocity", 2).tolist() == [0.0]


def test_a_rebuild_holds_the_moved_state_twice_for_one_table_at_most(monkeypatch):
    """When a table's tensor of the new key is re-laid, the per-parameter pieces it was made
    from have left the tables re-laid before it: the old layout's state and the new one's
    lie side by side for one table's tensor, not for every table's until the end."""
    store = TensorStore()
    store.follow((0, 1, 2), (0, 1, 2), NUMELS)
    for name in ("residual", "velocity", "server_residual"):
        store.put(name, (0, 1, 2), torch.arange(6.0))
    relaid, held = TensorStore._relaid, []

    def watched(own, previous, order, numels, name, found):
        held.append((name, {t: sorted(k for k in table if k != (1, 2)) for t, table in store.tables.items()}))
        return relaid(own, previous, order, numels, name, found)

    monkeypatch.setattr(TensorStore, "_relaid", staticmethod(watched))
    store.follow((1, 2), (2, 1), NUMELS)  # DDP rebuilt: (0, 1, 2) is cut per parameter first
    assert held == [
        ("residual", {"residual": [0, 1, 2], "velocity": [0, 1, 2], "server_residual": [0, 1, 2]}),
        ("velocity", {"residual": [0], "velocity": [0, 1, 2], "server_residual": [0, 1, 2]}),
        ("server_residual", {"residual": [0], "velocity": [0], "server_residual": [0, 1, 2]}),
    ]
    assert store.get("velocity", (1, 2)).tolist() == [5.0, 2.0, 3.0, 4.0]
    assert {t: sorted(k for k in table if k != (1, 2)) for t, table in store.tables.items()} == {
        "residual": [0],
        "velocity": [0],
        "server_residual": [0],
    }


def test_follow_regroups_pending_state_inside_a_transaction():
    store = TensorStore()
    store.follow((0, 1), (0, 1), NUMELS)
    store.begin()
    store.put("residual", (0, 1), torch.arange(5.0))
    store.follow(1, (1,), NUMELS)
    assert store.get("residual", 1).tolist() == [2.0, 3.0, 4.0]
    store.rollback()
    assert store.get("residual", 1) is None


def test_state_dict_round_trip_clones():
    store = TensorStore()
    store.follow("k", (1, 0), NUMELS)
    store.put("residual", "k", torch.arange(5.0))
    saved = store.state_dict()
    store.get("residual", "k").zero_()  # the checkpoint holds a copy
    other = TensorStore()
    other.load_state_dict(saved)
    assert other.get("residual", "k").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert other.layouts == {"k": (1, 0)}
    with pytest.raises(InvalidOptionError, match="missing \\['layouts'\\]"):
        other.load_state_dict({"tables": {}})


def test_canonical_lays_a_key_out_in_parameter_number_order():
    store = TensorStore()
    assert store.canonical("unknown") is None
    store.follow((0, 1, 2), (2, 0, 1), NUMELS)
    canonical = store.canonical((0, 1, 2))
    # flat: parameter 2 (one element), then 0 (two), then 1 (three); written out by hand
    flat = torch.tensor([20.0, 0.0, 1.0, 10.0, 11.0, 12.0])
    assert canonical.to_canonical(flat).tolist() == [0.0, 1.0, 10.0, 11.0, 12.0, 20.0]
    assert torch.equal(canonical.to_flat(canonical.to_canonical(flat)), flat)
    # canonical position -> flat position: 0->1, 1->2, 2->3, 4->5, 5->0
    assert canonical.flat_positions(torch.tensor([5, 0, 4, 1, 2])).tolist() == [0, 1, 5, 2, 3]
    store.follow((0, 1, 2), (0, 1, 2), NUMELS)
    assert store.canonical((0, 1, 2)).identity


def test_a_rebuild_holds_the_old_buckets_state_once_and_rolls_back_to_the_same_values():
    """Oracle: the values written by hand. The old bucket is cut per parameter when a new
    bucket first takes from it, each parameter's key goes once re-laid, and a rolled-back
    step leaves every parameter's state where the next step finds it."""
    store = TensorStore()
    store.follow((0, 1, 2), (0, 1, 2), NUMELS)
    store.put("residual", (0, 1, 2), torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0, 20.0]))
    store.put("threshold", (0, 1, 2), torch.tensor([9.0]))  # a per-key scalar stays with its key
    store.begin()
    store.follow((2,), (2,), NUMELS)  # DDP rebuilt: parameter 2 alone, then 1 and 0
    assert (0, 1, 2) not in store.tables["residual"] and (0, 1, 2) not in store.layouts
    assert store.tables["residual"].keys() == {0, 1, (2,)}  # nothing held twice
    assert store.get("threshold", (0, 1, 2)).tolist() == [9.0]
    store.put("residual", (2,), torch.tensor([21.0]))  # the step's new state
    store.follow((0, 1), (1, 0), NUMELS)
    assert store.tables["residual"].keys() == {(2,), (0, 1)}
    assert store.get("residual", (0, 1)).tolist() == [10.0, 11.0, 12.0, 0.0, 1.0]
    store.rollback()
    assert store.get("residual", (2,)).tolist() == [20.0] and store.get("residual", (0, 1)) is not None
    store.follow((0, 1, 2), (0, 1, 2), NUMELS)  # back to the first layout: every value found
    assert store.get("residual", (0, 1, 2)).tolist() == [0.0, 1.0, 10.0, 11.0, 12.0, 20.0]
