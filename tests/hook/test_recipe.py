"""DGC's recipe: the optimizer takeover, momentum correction by hand, clipping, the density schedule."""

import math

import pytest
import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.store import Canonical
from gradsift.hook import recipe
from gradsift.hook.feedback import ErrorFeedback
from gradsift.hook.state import GradsiftHookState


def _model_and_numbers():
    model = torch.nn.Linear(3, 2)
    return model, {id(p): i for i, p in enumerate(model.parameters())}


def test_takeover_moves_momentum_and_weight_decay_and_survives_a_resume_in_either_order():
    model, numbers = _model_and_numbers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    taken = recipe.take_over(optimizer, numbers)
    assert taken.momentum == 0.9 and taken.weight_decay == {0: 1e-4, 1: 1e-4}
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.0, 0.0)
    assert (group[recipe.MOMENTUM_KEY], group[recipe.WEIGHT_DECAY_KEY]) == (0.9, 1e-4)
    saved = optimizer.state_dict()
    # resume: hook first, then the optimizer checkpoint -- or the other way round
    for hook_first in (True, False):
        fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        if hook_first:
            again = recipe.take_over(fresh, numbers)
            fresh.load_state_dict(saved)
        else:
            fresh.load_state_dict(saved)
            again = recipe.take_over(fresh, numbers)
        assert again == taken
        assert (fresh.param_groups[0]["momentum"], fresh.param_groups[0]["weight_decay"]) == (0.0, 0.0)


def test_takeover_refuses_what_it_cannot_apply_exactly():
    model, numbers = _model_and_numbers()
    with pytest.raises(InvalidOptionError, match="Adagrad .*LAMB, Adafactor, Lion"):
        recipe.take_over(torch.optim.Adagrad(model.parameters()), numbers)
    with pytest.raises(InvalidOptionError, match="needs a dense warm-up"):  # Adam: see hook/test_adam.py
        recipe.take_over(torch.optim.Adam(model.parameters()), numbers, warmup_steps=0)
    with pytest.raises(InvalidOptionError, match="nesterov=True and dampening"):
        recipe.take_over(torch.optim.SGD(model.parameters(), lr=1, momentum=0.9, nesterov=True), numbers)
    with pytest.raises(InvalidOptionError, match="nesterov=True and dampening"):
        recipe.take_over(torch.optim.SGD(model.parameters(), lr=1, momentum=0.9, dampening=0.1), numbers)
    maximizing = torch.optim.SGD(model.parameters(), lr=1, momentum=0.9, weight_decay=1e-4, maximize=True)
    with pytest.raises(InvalidOptionError, match="maximize=True with weight_decay"):
        recipe.take_over(maximizing, numbers)
    assert maximizing.param_groups[0]["weight_decay"] == 1e-4  # left as built
    assert recipe.take_over(torch.optim.SGD(model.parameters(), lr=1, momentum=0.9, maximize=True), numbers)
    groups = [{"params": [model.weight], "momentum": 0.9}, {"params": [model.bias], "momentum": 0.5}]
    disagreeing = torch.optim.SGD(groups, lr=1)
    with pytest.raises(InvalidOptionError, match="different momenta"):
        recipe.take_over(disagreeing, numbers)
    assert [group["momentum"] for group in disagreeing.param_groups] == [0.9, 0.5]  # left as built


def test_takeover_leaves_a_group_with_other_parameters_alone():
    """A group that also holds parameters outside the model would lose their momentum and weight
    decay with the model's: refused, the group untouched; groups of its own are taken over."""
    model, numbers = _model_and_numbers()
    other = torch.nn.Parameter(torch.zeros(4))
    shared = torch.optim.SGD([*model.parameters(), other], lr=0.1, momentum=0.9, weight_decay=1e-4)
    with pytest.raises(
        InvalidOptionError, match=r"param group 0 holds 1 parameter\(s\) besides those DDP exchanges"
    ):
        recipe.take_over(shared, numbers)
    assert (shared.param_groups[0]["momentum"], shared.param_groups[0]["weight_decay"]) == (0.9, 1e-4)
    assert recipe.foreign_parameters(shared, numbers) == {0: 1}
    apart = torch.optim.SGD([{"params": model.parameters()}, {"params": [other]}], lr=0.1, momentum=0.9)
    assert recipe.foreign_parameters(apart, numbers) == {}
    assert recipe.take_over(apart, numbers).momentum == 0.9
    assert [group["momentum"] for group in apart.param_groups] == [0.0, 0.9]


def test_momentum_correction_and_masking_two_steps_by_hand():
    # m = 0.5; the compressor sends element 0 at step 1 and element 1 at step 2.
    for masking in (True, False):
        feedback = ErrorFeedback(momentum=0.5, momentum_masking=masking)
        g1, g2 = torch.tensor([4.0, 2.0]), torch.tensor([2.0, 6.0])
        c1 = feedback.compensate("w", g1)  # u1 = g1 = [4, 2], c1 = u1
        assert c1.tolist() == [4.0, 2.0]
        feedback.update(
            "w", c1, Payload(numel=2, dtype=torch.float32, values=c1[:1].clone(), indices=torch.tensor([0]))
        )
        assert feedback.residuals["w"].tolist() == [0.0, 2.0]
        assert feedback.velocities["w"].tolist() == ([0.0, 2.0] if masking else [4.0, 2.0])
        c2 = feedback.compensate("w", g2)
        # masked:   u2 = 0.5 * [0, 2] + [2, 6] = [2, 7],  c2 = r1 + u2 = [2, 9]
        # unmasked: u2 = 0.5 * [4, 2] + [2, 6] = [4, 7],  c2 = [4, 9]
        assert c2.tolist() == ([2.0, 9.0] if masking else [4.0, 9.0])
        feedback.update(
            "w", c2, Payload(numel=2, dtype=torch.float32, values=c2[1:].clone(), indices=torch.tensor([1]))
        )
        assert feedback.residuals["w"].tolist() == ([2.0, 0.0] if masking else [4.0, 0.0])
        assert feedback.velocities["w"].tolist() == ([2.0, 0.0] if masking else [4.0, 7.0])


def test_dense_contribution_leaves_no_residual_and_keeps_the_velocity():
    feedback = ErrorFeedback(momentum=0.9)
    c = feedback.compensate(0, torch.tensor([1.0, -2.0]))
    feedback.update(0, c, c)  # a dense step sent everything: nothing left, momentum kept
    assert feedback.residuals[0].tolist() == [0.0, 0.0]
    assert feedback.velocities[0].tolist() == [1.0, -2.0]
    assert feedback.compensate(0, torch.tensor([1.0, 1.0])).tolist() == pytest.approx([1.9, -0.8])


def test_feedback_refuses_a_tensor_that_changed_shape_or_dtype():
    feedback = ErrorFeedback(momentum=0.5)
    c = feedback.compensate("b", torch.ones(3))
    feedback.update(
        "b", c, Payload(numel=3, dtype=torch.float32, values=c[:1].clone(), indices=torch.tensor([0]))
    )
    with pytest.raises(InvalidOptionError, match=r"tensor 'b' changed from \(3,\)/torch.float32 to \(4,\)"):
        feedback.compensate("b", torch.ones(4))
    with pytest.raises(InvalidOptionError, match="torch.float64"):
        feedback.compensate("b", torch.ones(3, dtype=torch.float64))


def test_density_schedule_is_exponential_from_start_to_target():
    assert recipe.density_at(0, 0.001, 4, 0.25) == 0.25
    assert recipe.density_at(1, 0.001, 4, 0.25) == pytest.approx(0.25 * (0.004) ** 0.25)
    assert recipe.density_at(2, 0.001, 4, 0.25) == pytest.approx(math.sqrt(0.25 * 0.001))
    assert recipe.density_at(4, 0.001, 4, 0.25) == 0.001
    assert recipe.density_at(100, 0.001, 4, 0.25) == 0.001
    assert recipe.density_at(0, 0.5, 4, 0.25) == 0.5  # a start below the target: no warm-up


def test_local_clipping_threshold_splits_over_parts_and_workers():
    flat = torch.tensor([3.0, 4.0])  # norm 5
    # part of 2 elements in a 8-element model on 4 workers: t = 10 * sqrt(2/8) / 2 = 2.5
    clipped = recipe.clip_local(flat, 10.0, 2, 8, 4)
    assert clipped.tolist() == pytest.approx([1.5, 2.0])
    assert torch.equal(recipe.clip_local(flat, 100.0, 2, 8, 4), flat)  # under the threshold: unchanged
    nan = torch.tensor([float("nan"), 1.0])
    kept = recipe.clip_local(nan, 1.0, 2, 2, 1)  # non-finite passes to the flag check as it is
    assert kept[1] == 1.0 and kept[0].isnan()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["flat", "canonical"])
def test_local_clipping_takes_the_norm_of_every_gradient_dtype(dtype, layout):
    flat = torch.tensor([3.0, 0.0, 4.0, 12.0], dtype=dtype)  # parameters of 1, 1 and 2 elements
    canonical = Canonical([2, 0, 1], {0: 1, 1: 1, 2: 2}) if layout == "canonical" else None
    norm = recipe.canonical_norm(flat, canonical)
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert norm.item() == 13.0  # sqrt(9 + 16 + 144)
    clipped = recipe.clip_local(flat, 6.5, 4, 4, 1, canonical)  # threshold 6.5: half the norm
    assert clipped.dtype == dtype and clipped.tolist() == [1.5, 0.0, 2.0, 6.0]


def test_weight_decay_is_added_per_parameter_of_a_part_that_requires_grad():
    weight = torch.full((2, 2), 2.0, requires_grad=True)
    bias = torch.tensor([10.0], requires_grad=True)
    frozen = torch.tensor([4.0, 4.0])  # SGD skips it: no gradient, no decay
    flat = torch.zeros(7)
    recipe.add_weight_decay(flat, [weight, bias, frozen], [3, 7, 8], {7: 0.5, 8: 0.5})
    assert flat.tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0]


def test_hook_state_takes_over_only_with_error_feedback():
    model = torch.nn.Linear(3, 2)
    for name, takes in (("topk", True), ("bf16", False)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = GradsiftHookState.build(name)
        fake = type("FakeDDP", (), {"module": model, "process_group": None})()
        state.attach(fake, optimizer)
        assert (optimizer.param_groups[0]["momentum"] == 0.0) is takes
        assert (state.feedback is not None and state.feedback.momentum == 0.9) is takes
    state = GradsiftHookState.build("topk", momentum=0.5)
    with pytest.raises(InvalidOptionError, match="momentum=0.5 disagrees with the optimizer's momentum 0.9"):
        state.attach(fake, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
