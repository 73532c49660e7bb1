"""A checkpoint's hook state is checked before it is loaded: crafted entries (a NaN residual,
a negative step, another compressor or ratio, a negative capacity, another shape or dtype,
...) are refused by ``load_hook_state`` with an error naming what is wrong, and the hook is
left exactly as it was; a genuine checkpoint, with or without its saved settings, loads.

One process on gloo: the checks do not depend on the world size, and a crafted entry is
built by editing a genuine one (``gather_hook_states`` of a one-rank group).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state
from support.models import batch, make_model, same

KEY = (0, 1, 2, 3)  # the one bucket of support.models.make_model: 259 elements
ELEMENTS = 259


def trained(compressor: str, steps: int = 3, **options) -> tuple[DDP, gradsift.hook.state.GradsiftHookState]:
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradsift.register_comm_hook(model, compressor, optimizer=optimizer, **options)
    for step in range(steps):
        x, y = batch(0, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, state


@pytest.fixture(scope="module")
def saved(one_process_group: None) -> dict[str, dict]:
    """Genuine gathered checkpoints of topk (ratio 0.1), VGC and DGC hooks after 3 steps."""
    return {
        "topk": gather_hook_states(trained("topk", ratio=0.1)[1]),
        "vgc": gather_hook_states(trained("vgc")[1]),
        "dgc": gather_hook_states(trained("dgc", ratio=0.1)[1]),
        "sidco-exp": gather_hook_states(trained("sidco-exp", ratio=0.1)[1]),
        "topk 0.01": gather_hook_states(trained("topk", ratio=0.01)[1]),
    }


def entry(checkpoint: dict) -> dict:
    return checkpoint["ranks"][0]


def nan_residual(c: dict) -> None:
    entry(c)["store"]["tables"]["residual"][KEY][7] = math.nan


def inf_velocity(c: dict) -> None:
    entry(c)["store"]["tables"]["velocity"][KEY][0] = math.inf


def short_residual(c: dict) -> None:
    entry(c)["store"]["tables"]["residual"][KEY] = entry(c)["store"]["tables"]["residual"][KEY][:-1]


def integer_residual(c: dict) -> None:
    entry(c)["store"]["tables"]["residual"][KEY] = torch.zeros(ELEMENTS, dtype=torch.int64)


def matrix_residual(c: dict) -> None:
    entry(c)["store"]["tables"]["residual"][KEY] = torch.zeros(1, ELEMENTS)


def key_of_another_model(c: dict) -> None:
    table = entry(c)["store"]["tables"]["residual"]
    table[(0, 1, 2, 3, 9)] = table.pop(KEY)


def layout_not_of_its_key(c: dict) -> None:
    entry(c)["store"]["layouts"][KEY] = (3, 2, 1, 1)


def negative_step(c: dict) -> None:
    entry(c)["step"] = -1


def no_store(c: dict) -> None:
    del entry(c)["store"]


def negative_telemetry(c: dict) -> None:
    entry(c)["telemetry"]["total"]["bytes_sent"] = -5


def negative_weight_decay(c: dict) -> None:
    entry(c)["weight_decay"][0] = -0.1


def momentum_of_one(c: dict) -> None:
    entry(c)["feedback"]["momentum"] = 1.0


#: (checkpoint, the edit, the hook it is loaded into, what the error says)
CRAFTED: dict[str, tuple[str, Callable[[dict], None], str, str]] = {
    "NaN residual": ("topk", nan_residual, "topk", r"store\['residual'\]\[\(0, 1, 2, 3\)\] holds NaN or Inf"),
    "Inf velocity": ("topk", inf_velocity, "topk", r"store\['velocity'\]\[\(0, 1, 2, 3\)\] holds NaN or Inf"),
    "negative step": ("topk", negative_step, "topk", r"step must be an integer >= 0, got -1"),
    "another compressor": ("sidco-exp", lambda c: None, "topk",
                           r'compressor: "sidco-exp" in the checkpoint, "topk" in this hook'),
    "another ratio": ("topk 0.01", lambda c: None, "topk",
                      r"compressor option ratio: 0.01 in the checkpoint, 0.1 in this hook"),
    "negative capacity": ("vgc", lambda c: entry(c)["capacities"]["rooms"].update({KEY: -5}), "vgc",
                          r"the capacity of \(0, 1, 2, 3\) must be an integer in \[1, 259\].*got -5"),
    "capacity beyond the part": ("vgc", lambda c: entry(c)["capacities"]["rooms"].update({KEY: 260}), "vgc",
                                 r"must be an integer in \[1, 259\]"),
    "another shape": ("topk", short_residual, "topk", r"holds 258 values for parameters of 259 elements"),
    "another dtype": ("topk", integer_residual, "topk", r"must hold floating-point values, got torch.int64"),
    "not 1-D": ("topk", matrix_residual, "topk", r"must be a 1-D tensor, got a 2-D tensor"),
    "another model": ("topk", key_of_another_model, "topk", r"names parameters \[9\] this model does not have"),
    "bad layout": ("topk", layout_not_of_its_key, "topk", r"store layout \(0, 1, 2, 3\) must order its key's numbers"),
    "no store": ("topk", no_store, "topk", r"is not a gradsift hook state: missing \['store'\]"),
    "negative telemetry": ("topk", negative_telemetry, "topk", r"telemetry total 'bytes_sent' must be finite and >= 0"),
    "negative weight decay": ("topk", negative_weight_decay, "topk", r"weight_decay\[0\] must be finite and >= 0"),
    "momentum of one": ("topk", momentum_of_one, "topk", r"feedback must be None or \{'momentum': m\} with m in \[0, 1\)"),
    "auto's left not a dict": ("topk", lambda c: entry(c).update(auto={"left": ["sidco-exp"]}), "topk",
                               r"auto's methods left must be \{method name: why\}, got \['sidco-exp'\]"),
    "negative count": ("dgc", lambda c: entry(c)["compressor"]["calls"].update({KEY: -1}), "dgc",
                       r"compressor state\['calls'\]\[\(0, 1, 2, 3\)\] must be >= 0, got -1"),
}  # fmt: skip
HOOKS = {"topk": {"ratio": 0.1}, "vgc": {}, "dgc": {"ratio": 0.1}}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checkpoint_is_refused_and_the_hook_left_as_it_was(saved: dict, case: str) -> None:
    source, edit, hook, message = CRAFTED[case]
    checkpoint = copy.deepcopy(saved[source])
    edit(checkpoint)
    _, state = trained(hook, steps=1, **HOOKS[hook])
    before = state.state_dict()
    with pytest.raises(InvalidOptionError, match=message):
        load_hook_state(state, checkpoint)
    assert same(state.state_dict(), before)


@pytest.mark.distributed
@pytest.mark.parametrize("with_settings", [True, False], ids=["saved settings", "older checkpoint"])
def test_a_genuine_checkpoint_loads(saved: dict, with_settings: bool) -> None:
    checkpoint = copy.deepcopy(saved["vgc"])
    assert checkpoint["settings"]["compressor"] == '"vgc"'
    if not with_settings:
        del checkpoint["settings"]
    _, state = trained("vgc", steps=1)
    load_hook_state(state, checkpoint)
    assert same(state.state_dict(), saved["vgc"]["ranks"][0])


@pytest.mark.distributed
def test_a_load_that_fails_half_way_leaves_the_hook_as_it_was(saved: dict) -> None:
    """An entry the checks pass but the compressor refuses (topk keeps no state): the store,
    loaded before the compressor, is put back."""
    checkpoint = copy.deepcopy(saved["topk"])
    del checkpoint["settings"]
    entry(checkpoint)["compressor"] = {"calls": {KEY: 3}}
    _, state = trained("topk", steps=1, ratio=0.1)
    before = state.state_dict()
    with pytest.raises(InvalidOptionError, match="topk keeps no state"):
        load_hook_state(state, checkpoint)
    assert same(state.state_dict(), before)
    assert not same(before["store"], entry(checkpoint)["store"])  # the store did differ


@pytest.mark.distributed
@pytest.mark.parametrize("compressor", ["topk", "sidco-exp", "dgc"])
def test_a_checkpoint_made_while_the_density_warms_up_resumes_exactly(
    one_process_group: None, compressor: str
) -> None:
    """``density_warmup_steps`` moves the sparsifier's ratio from dense to its target step by
    step; the settings saved with the checkpoint name the target, so a checkpoint made half way
    loads into a hook built as the run was and repeats its last steps bit for bit (oracle: the
    uninterrupted run). Before, the settings held the step's ratio and ``load_hook_state``
    refused the checkpoint ("compressor option ratio: ... in the checkpoint, 0.05 in this hook")."""
    options = {"ratio": 0.05, "density_warmup_steps": 8, "warmup_steps": 1}
    model, state = trained(compressor, steps=3, **options)
    optimizer = state.optimizer
    saved = copy.deepcopy({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": gather_hook_states(state)
    })  # fmt: skip
    assert state.compressor.ratio > options["ratio"]  # half way through the density's warm-up

    def steps(model: DDP, optimizer: torch.optim.Optimizer) -> None:
        for step in range(3, 6):
            x, y = batch(0, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    steps(model, optimizer)
    again, resumed = trained(compressor, steps=0, **options)
    again.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    load_hook_state(resumed, saved["hook"])
    steps(again, resumed.optimizer)
    for ours, theirs in zip(again.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["sgd-momentum", "adam"])
def test_a_checkpoint_after_a_weight_decay_schedule_resumes_exactly(
    one_process_group: None, family: str
) -> None:
    """The optimizer passed, its weight decay changed at step 2 (a schedule): the hook takes the
    new value, so the settings saved at step 4 name it, while a fresh hook holds the optimizer's
    value as built until the loaded optimizer's next step. The checkpoint loads and repeats the
    uninterrupted run's last steps bit for bit (oracle: that run). Before, ``load_hook_state``
    refused it ("weight decay taken from the optimizer: ... 0.0005 ... in the checkpoint, ...
    0.001 ... in this hook")."""

    def fresh() -> tuple[DDP, torch.optim.Optimizer, gradsift.hook.state.GradsiftHookState]:
        model = DDP(make_model())
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
            if family == "sgd-momentum"
            else torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-3)
        )
        options = {"ratio": 0.1} if family == "sgd-momentum" else {"ratio": 0.1, "warmup_steps": 1}
        return model, optimizer, gradsift.register_comm_hook(model, "topk", optimizer=optimizer, **options)

    def steps(model: DDP, optimizer: torch.optim.Optimizer, first: int, stop: int) -> None:
        for step in range(first, stop):
            if step == 2:
                for group in optimizer.param_groups:
                    group["weight_decay"] = 5e-4
            x, y = batch(0, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer, state = fresh()
    steps(model, optimizer, 0, 4)
    saved = copy.deepcopy({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": gather_hook_states(state)
    })  # fmt: skip
    assert "0.0005" in saved["hook"]["settings"]["weight decay taken from the optimizer"]
    steps(model, optimizer, 4, 7)
    again, again_optimizer, again_state = fresh()
    again.load_state_dict(saved["model"])
    again_optimizer.load_state_dict(saved["optimizer"])
    load_hook_state(again_state, saved["hook"])
    steps(again, again_optimizer, 4, 7)
    for ours, theirs in zip(again.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
