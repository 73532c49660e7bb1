"""ErrorFeedback's rules on hand-computed examples: ``c = g + r`` (or ``r + u`` with DGC's
velocity ``u <- m u + g``), ``r <- c - s`` for each kind of contribution (sparse at full
precision, sparse rounded to fp16, quantized, dense), reset, the checkpoint and its
checks, and the shared store. Complements test_core_api's and test_recipe's feedback tests.
"""

from __future__ import annotations

import pytest
import torch

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.store import TensorStore
from gradsift.hook.feedback import ErrorFeedback


def sparse(values: list[float], indices: list[int], numel: int, dtype=torch.float32) -> Payload:
    return Payload(
        numel=numel,
        dtype=torch.float32,
        values=torch.tensor(values, dtype=dtype),
        indices=torch.tensor(indices),
    )


def test_compensate_adds_the_residual_to_a_flattened_copy():
    feedback = ErrorFeedback()
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    first = feedback.compensate("w", g)
    assert first.tolist() == [1.0, 2.0, 3.0, 4.0] and first.data_ptr() != g.data_ptr()
    feedback.update("w", first, sparse([4.0], [3], 4))
    assert feedback.residuals["w"].tolist() == [1.0, 2.0, 3.0, 0.0]
    second = feedback.compensate("w", torch.full((2, 2), 0.5))
    assert second.tolist() == [1.5, 2.5, 3.5, 0.5]
    assert g.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert feedback.residuals["w"].tolist() == [1.0, 2.0, 3.0, 0.0]  # compensate does not consume r
    assert feedback.velocities == {}  # no momentum correction, no velocity


def test_values_rounded_to_fp16_leave_their_rounding_error_in_the_residual():
    feedback = ErrorFeedback()
    c = feedback.compensate(0, torch.tensor([1.0 + 2**-12, 3.0, -5.0 - 2**-11]))
    feedback.update(0, c, sparse([1.0, -5.0], [0, 2], 3, dtype=torch.float16))
    # fp16 has 10 mantissa bits: 1 + 2^-12 rounds to 1, -5 - 2^-11 to -5
    assert feedback.residuals[0].tolist() == [2**-12, 3.0, -(2**-11)]


def test_a_quantized_contribution_is_decoded_with_its_compressor():
    compressor = gradsift.get_compressor("fp16")
    feedback = ErrorFeedback()
    g = torch.tensor([1.0 + 2**-12, -2.0])
    c = feedback.compensate(0, g)
    payload = compressor.compress(c)
    feedback.update(0, c, payload, compressor)
    assert feedback.residuals[0].tolist() == [2**-12, 0.0]
    c = feedback.compensate(0, g)
    with pytest.raises(
        InvalidOptionError, match=r"^update\(\) needs the compressor to decode a payload without indices$"
    ):
        feedback.update(0, c, compressor.compress(c))


def test_a_dense_contribution_leaves_its_difference():
    feedback = ErrorFeedback()
    c = feedback.compensate("d", torch.tensor([1.0, 2.0, 3.0]))
    feedback.update("d", c, torch.tensor([[0.5, 2.0, 4.0]], dtype=torch.float64))
    assert feedback.residuals["d"].tolist() == [0.5, 0.0, -1.0]
    assert feedback.residuals["d"].dtype == torch.float32


def test_a_residual_that_changed_shape_or_dtype_is_refused_without_momentum():
    feedback = ErrorFeedback()
    feedback.update("r", feedback.compensate("r", torch.ones(3)), sparse([1.0], [0], 3))
    with pytest.raises(
        InvalidOptionError, match=r"tensor 'r' changed from \(3,\)/torch.float32 to \(2,\)/torch.float32"
    ):
        feedback.compensate("r", torch.ones(2))
    with pytest.raises(InvalidOptionError, match=r"call reset\('r'\) when a bucket is rebuilt"):
        feedback.compensate("r", torch.ones(3, dtype=torch.float64))
    # a 16-bit gradient accumulates into the float32 residual: widened, not refused
    assert feedback.compensate("r", torch.ones(3, dtype=torch.bfloat16)).dtype == torch.float32


def test_momentum_must_lie_in_zero_one():
    assert ErrorFeedback(momentum=0.0).momentum == 0.0
    assert ErrorFeedback(momentum=0.999).momentum == 0.999
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(InvalidOptionError, match=r"^momentum must lie in \[0.0, 1.0\), got "):
            ErrorFeedback(momentum=bad)


def test_momentum_masking_zeroes_only_the_sent_positions_of_the_velocity():
    feedback = ErrorFeedback(momentum=0.5)
    c = feedback.compensate(0, torch.tensor([1.0, 2.0, 3.0]))
    feedback.update(0, c, sparse([1.0, 3.0], [0, 2], 3))
    assert feedback.velocities[0].tolist() == [0.0, 2.0, 0.0]
    # a dense contribution masks nothing
    c = feedback.compensate(0, torch.tensor([1.0, 1.0, 1.0]))  # u = [1, 2, 1], c = r + u = [1, 2 + 2, 1]
    assert c.tolist() == [1.0, 4.0, 1.0]
    feedback.update(0, c, c)
    assert feedback.velocities[0].tolist() == [1.0, 2.0, 1.0]


def test_reset_forgets_one_key_or_every_key():
    feedback = ErrorFeedback(momentum=0.5)
    for key in ("a", "b"):
        feedback.update(key, feedback.compensate(key, torch.ones(2)), sparse([1.0], [0], 2))
    feedback.reset("a")
    assert set(feedback.residuals) == {"b"} and set(feedback.velocities) == {"b"}
    assert feedback.compensate("a", torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # a new shape is fine now
    feedback.reset()
    assert feedback.residuals == {} and feedback.velocities == {}


def test_checkpoint_clones_replaces_and_checks_momentum():
    feedback = ErrorFeedback(momentum=0.5)
    feedback.update("a", feedback.compensate("a", torch.tensor([1.0, 2.0])), sparse([2.0], [1], 2))
    state = feedback.state_dict()
    assert state["momentum"] == 0.5
    assert state["residuals"]["a"].tolist() == [1.0, 0.0] and state["velocities"]["a"].tolist() == [1.0, 0.0]
    state["residuals"]["a"].add_(100.0)  # a clone: the feedback's residual is unchanged
    assert feedback.residuals["a"].tolist() == [1.0, 0.0]

    other = ErrorFeedback(momentum=0.5)
    other.update("stale", other.compensate("stale", torch.ones(2)), sparse([1.0], [0], 2))
    other.load_state_dict(feedback.state_dict())
    assert set(other.residuals) == {"a"} and set(other.velocities) == {"a"}  # the stale key is gone
    assert other.residuals["a"].tolist() == [1.0, 0.0]
    assert other.compensate("a", torch.ones(2)).tolist() == feedback.compensate("a", torch.ones(2)).tolist()

    # a checkpoint without the momentum entry is taken as made with this feedback's momentum
    legacy = {"residuals": {"x": torch.ones(2)}, "velocities": {}}
    plain = ErrorFeedback()
    plain.load_state_dict(legacy)
    assert plain.residuals["x"].tolist() == [1.0, 1.0]
    legacy["residuals"]["x"].zero_()
    assert plain.residuals["x"].tolist() == [1.0, 1.0]  # loaded as a copy
    with pytest.raises(
        InvalidOptionError, match="checkpoint was made with momentum=0.5, this feedback has 0.9"
    ):
        ErrorFeedback(momentum=0.9).load_state_dict(feedback.state_dict())


def test_state_lives_in_the_given_store_and_follows_its_transactions():
    store = TensorStore()
    feedback = ErrorFeedback(momentum=0.5, store=store)
    assert feedback.store is store
    feedback.update(0, feedback.compensate(0, torch.tensor([1.0, 2.0])), sparse([1.0], [0], 2))
    assert store.get("residual", 0).tolist() == [0.0, 2.0]
    assert store.get("velocity", 0).tolist() == [0.0, 2.0]
    store.begin()
    feedback.update(0, feedback.compensate(0, torch.tensor([1.0, 1.0])), sparse([4.0], [1], 2))
    assert feedback.residuals[0].tolist() == [1.0, 0.0]
    store.rollback()  # a skipped step leaves no trace
    assert feedback.residuals[0].tolist() == [0.0, 2.0] and feedback.velocities[0].tolist() == [0.0, 2.0]
    assert ErrorFeedback().store is not ErrorFeedback().store


@pytest.mark.parametrize(
    ("decay", "masking", "values"),
    [(1.0, True, True), (0.9, True, True), (1.0, False, True), (1.0, True, False)],
)
def test_a_residual_kept_lazily_has_the_bits_of_one_kept_from_the_compensated_gradient(
    decay, masking, values
):
    """Without ``c`` the residual is made at the commit, in place in the old one (a new one on
    the first step): the same bits as ``c - s`` (values rounded to bf16, padding entries,
    positions only), the same velocity; a rolled-back step leaves both as they were."""
    generator = torch.Generator().manual_seed(3)
    n, k, padding = 1000, 37, 3
    kept, lazy = (ErrorFeedback(momentum=0.9, momentum_masking=masking, decay=decay) for _ in range(2))
    for step in range(5):
        gradient = torch.randn(n, generator=generator) * 3
        c = kept.compensate("w", gradient)
        indices = torch.sort(torch.randperm(n, generator=generator)[:k]).values
        indices = torch.cat([indices, torch.zeros(padding, dtype=torch.long)])
        used = torch.arange(k + padding) < k
        sent = torch.where(used, c[indices], 0).to(torch.bfloat16) if values else None
        payload = Payload(numel=n, dtype=torch.float32, values=sent, indices=indices, length=torch.tensor(k))
        kept.update("w", c, payload)
        before = {
            name: table.get("w")
            for name, table in (("residual", lazy.residuals), ("velocity", lazy.velocities))
        }
        old = {name: None if t is None else t.clone() for name, t in before.items()}
        lazy.store.begin()
        lazy.compensate("w", gradient)
        lazy.update("w", None, payload)
        assert lazy.store.get("residual", "w") is before["residual"]  # nothing until the commit
        if step == 2:  # dropped on some rank
            lazy.store.rollback()
            for name, table in (("residual", lazy.residuals), ("velocity", lazy.velocities)):
                assert table["w"] is before[name] and torch.equal(table["w"], old[name])
            kept.load_state_dict(lazy.state_dict())
            continue
        lazy.store.commit()
        assert torch.equal(lazy.residuals["w"], kept.residuals["w"]), step
        assert torch.equal(lazy.velocities["w"], kept.velocities["w"]), step
        if step > 0:
            assert lazy.residuals["w"] is before["residual"]  # changed in place


def test_update_without_the_compensated_gradient_needs_what_makes_it_again():
    payload = sparse([1.0], [0], 2)
    for feedback, sent in ((ErrorFeedback(), payload), (ErrorFeedback(momentum=0.5), torch.ones(2))):
        assert not feedback.keeps_lazily(gradsift.get_compressor("qsgd")) and (
            feedback.keeps_lazily(gradsift.get_compressor("topk")) == (feedback.momentum > 0)
        )
        with pytest.raises(InvalidOptionError, match="needs momentum correction and a sparse payload"):
            feedback.update(0, None, sent)


def test_a_payload_of_positions_only_zeroes_them():
    feedback = ErrorFeedback()
    c = feedback.compensate(0, torch.tensor([1.0, 2.0, 3.0]))
    feedback.update(0, c, Payload(numel=3, dtype=torch.float32, values=None, indices=torch.tensor([1])))
    assert feedback.residuals[0].tolist() == [1.0, 0.0, 3.0]


def test_reset_leaves_other_tables_of_a_shared_store_alone():
    """The hook's store also holds VGC's accumulators under the same keys: reset forgets
    only the residual and the velocity."""
    store = TensorStore()
    store.put("vgc.variance", "k", torch.ones(2))
    feedback = ErrorFeedback(momentum=0.5, store=store)
    feedback.update("k", feedback.compensate("k", torch.ones(2)), sparse([1.0], [0], 2))
    feedback.reset("k")
    assert store.get("residual", "k") is None and store.get("velocity", "k") is None
    assert store.get("vgc.variance", "k").tolist() == [1.0, 1.0]
    feedback.update("k", feedback.compensate("k", torch.ones(2)), sparse([1.0], [0], 2))
    feedback.reset()
    assert feedback.residuals == {} and store.get("vgc.variance", "k").tolist() == [1.0, 1.0]
