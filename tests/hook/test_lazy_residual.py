"""The sparsifiers' residual kept lazily under momentum correction (hook.feedback, step 3):
the route drops the compensated gradient once the allgather has encoded it, writes it over
the bucket's gradient, and error feedback makes the new residual in place at the commit.

Oracle: the same training with the laziness turned off (the allgather declared as an
exchange that reads its input late, so the route keeps ``c`` and error feedback consumes
it), which the tests of tests/hook and tests/exchanges check against brute force: the same
bits in the parameters and the hook's state after every step, a step dropped for a NaN
included; and during a step the old residual stays the stored one, unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.exchanges.allgather import Allgather
from support.models import batch, flat_params, hook_state, make_model, same

STEPS, DROPPED = 6, 3


def train(granularity: str, lazy: bool) -> list[tuple[torch.Tensor, dict]]:
    """Per step, the parameters and the hook's state; step ``DROPPED`` holds a NaN. ``lazy``:
    check that the residual the step sees until it settles is the old one, as it was (from the
    third step: the second re-lays the state into DDP's rebuilt buckets)."""
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradsift.register_comm_hook(
        model, "topk", ratio=0.1, granularity=granularity, optimizer=optimizer, nonfinite="skip"
    )
    after = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(0, step)
        if step == DROPPED:
            x[0, 0] = float("nan")
        residuals = dict(state.store.tables.get("residual", {}))
        saved = {key: tensor.clone() for key, tensor in residuals.items()}
        torch.nn.functional.mse_loss(model(x), y).backward()
        if lazy and step >= 2:
            for key, tensor in state.store.table("residual").items():  # before the step settles
                assert tensor is residuals[key] and torch.equal(tensor, saved[key])
        optimizer.step()
        after.append((flat_params(model), hook_state(state)))
    assert state.step == STEPS - 1
    return after


@pytest.mark.parametrize("granularity", ["bucket", "layer"])
def test_the_lazy_residual_trains_bit_for_bit_as_the_kept_one(
    granularity: str, one_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    lazy = train(granularity, lazy=True)
    monkeypatch.setattr(Allgather, "copies_input", False)
    kept = train(granularity, lazy=False)
    for step, ((params, state), (params_kept, state_kept)) in enumerate(zip(lazy, kept, strict=True)):
        assert torch.equal(params, params_kept), step
        assert same(state, state_kept), step
