"""What a user reads when a keyword is wrong or a default is wanted: a misspelt option is
refused with the names it could have meant and the closest of them, by each frontend that
takes keywords (the DDP hook, ``auto``, DiLoCo); ``help()`` of every entry point that takes
keywords shows their defaults. The expected suggestions are written out by hand; the defaults
are read from the signatures and the options' dataclasses themselves."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re

import pytest
import torch

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.core.spelling import closest, did_you_mean
from gradsift.frontends.decoupled_momentum import DeMoOptions
from gradsift.frontends.distributed_lion import LionOptions
from gradsift.hook.choice import auto_options
from gradsift.hook.options import HOOK_OPTIONS, HookOptions
from gradsift.hook.state import GradsiftHookState


def refusal(call) -> str:
    with pytest.raises(InvalidOptionError) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize(
    "name,meant",
    [("warmup_step", "warmup_steps"), ("ratoi", "ratio"), ("nonfinte", "nonfinite"), ("stges", "stages"),
     ("bogus", None)],
)  # fmt: skip
def test_the_hook_names_the_option_a_misspelt_one_meant(name: str, meant: str | None) -> None:
    message = refusal(lambda: GradsiftHookState.build("sidco-exp", **{name: 1}))
    assert message.startswith(f"unknown option(s) {name}")
    assert (f"(did you mean {meant}?)" in message) == (meant is not None), message
    assert ("did you mean" in message) == (meant is not None)
    hook, compressor = message.split("; ")
    assert set(HOOK_OPTIONS) == set(hook.split(" are ")[1].split(", "))
    assert (
        compressor
        == "compressor 'sidco-exp' takes ratio, first_ratio, stages, sample_size, adapt, stage_period, exact_below"
    )


@pytest.mark.parametrize(
    "name,meant", [("warmup_step", "warmup_steps"), ("compresor", "compressor"), ("ratio", None)]
)
def test_auto_names_the_option_a_misspelt_one_meant(name: str, meant: str | None) -> None:
    message = refusal(lambda: auto_options({name: 1}))
    assert f"got {name}" in message
    assert (f"(did you mean {meant}?)" in message) == (meant is not None), message
    assert "need compressor=<name>" in message  # ratio is a method's own: name the method


@pytest.mark.parametrize(
    "name,meant", [("sync_evry", "sync_every"), ("outer_l", "outer_lr"), ("unsnt", "unsent")]
)
def test_diloco_names_its_own_options_first(one_process_group, name: str, meant: str) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    message = refusal(lambda: gradsift.diloco(model, optimizer, **{name: 1}))
    assert message.startswith(f"unknown option(s) {name} (did you mean {meant}?): diloco's own options are ")
    own = message.split("diloco's own options are ")[1].split("; ")[0].split(", ")
    signature = inspect.signature(gradsift.diloco).parameters
    assert own == [p for p in signature if p not in ("model", "optimizer", "options")]
    hook = message.split("the hook's options are ")[1].split("; ")[0].split(", ")
    assert not {"optimizer", "granularity", "warmup_steps", "scaler"} & set(hook)  # diloco refuses them


def test_the_one_line_names_the_option_a_misspelt_one_meant(one_process_group) -> None:
    """What ``register_comm_hook`` says, with and without a named method."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    named = refusal(lambda: gradsift.register_comm_hook(model, "topk", ratio=0.01, warmup_step=3))
    assert named.startswith(
        "unknown option(s) warmup_step (did you mean warmup_steps?): the hook's options are "
    )
    auto = refusal(lambda: gradsift.register_comm_hook(model, compresor="topk"))
    assert "got compresor (did you mean compressor?)" in auto


@pytest.mark.parametrize("compressor", ["auto", "none", "topk"])
def test_a_value_of_the_wrong_type_is_refused_by_name(one_process_group, compressor: str) -> None:
    """``optimizer=`` and ``jsonl_path=`` of another type (were an ``AttributeError`` under
    ``auto`` and a ``TypeError`` at the first logged step)."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    wrong = refusal(lambda: gradsift.register_comm_hook(model, compressor, optimizer="adamw"))
    assert wrong == "optimizer must be a torch.optim.Optimizer, got str"
    path = refusal(lambda: gradsift.register_comm_hook(model, compressor, jsonl_path=1))
    assert path == "jsonl_path must be a path or None, got 1"


def test_closest_suggests_only_a_close_name() -> None:
    assert closest("ratoi", ["ratio", "rate_limit"]) == "ratio"
    assert closest("bogus", ["ratio", "stages"]) is None
    assert did_you_mean(["a", "b", "a"]) == " (did you mean a, b?)" and did_you_mean([]) == ""


def help_text(thing: object) -> str:
    """What ``help(thing)`` prints, its whitespace runs made single spaces."""
    return " ".join(pydoc.render_doc(thing, renderer=pydoc.plaintext).split())


@pytest.mark.parametrize(
    "entry,options",
    [
        (gradsift.register_comm_hook, HookOptions),
        (gradsift.DeMo, DeMoOptions),
        (gradsift.DistributedLion, LionOptions),
    ],
)
def test_help_shows_the_default_of_every_option_its_keywords_take(entry: object, options: type) -> None:
    text = help_text(entry)
    for field in dataclasses.fields(options):
        assert f"{field.name}={field.default!r}" in text, field.name


def test_help_shows_every_default_of_the_one_line_and_diloco() -> None:
    text = help_text(gradsift.register_comm_hook)
    assert "process_group=None" in text and "optimizer=None" in text
    diloco_help = help_text(gradsift.diloco)
    defaults = {
        name: p.default
        for name, p in inspect.signature(gradsift.frontends.diloco.diloco).parameters.items()
        if p.default is not p.empty
    }
    assert defaults.keys() >= {"sync_every", "compressor", "outer_lr", "unsent"}
    for name, default in defaults.items():
        assert re.search(rf"{name}: '[^']*' = {re.escape(repr(default))}", diloco_help), name


def test_the_trainer_callbacks_refuse_a_misspelt_option_when_made() -> None:
    """Lightning's and the Hugging Face Trainer's callbacks hold a ``PendingHook`` until the
    trainer has wrapped the model; a wrong keyword is refused when the callback is made, under
    ``auto`` too, not when ``fit`` starts."""
    from gradsift.integrations.hook_state import PendingHook

    assert "(did you mean warmup_steps?)" in refusal(lambda: PendingHook("auto", {"warmup_step": 3}))
    assert "(did you mean warmup_steps?)" in refusal(
        lambda: PendingHook("topk", {"ratio": 0.01, "warmup_step": 3})
    )
    assert PendingHook("auto", {"steps": 40, "warmup_steps": 5}).named is None  # what auto takes is kept
    for compressor in ("auto", "topk"):  # the trainer's optimizer is handed over by take_optimizer=
        assert "pass take_optimizer=True" in refusal(
            lambda c=compressor: PendingHook(c, {"optimizer": object()})
        )


def test_a_compressor_built_alone_names_the_option_a_misspelt_one_meant() -> None:
    message = refusal(lambda: gradsift.get_compressor("sidco-exp", stges=2))
    assert message == (
        "compressor 'sidco-exp' has no option(s) stges (did you mean stages?); "
        "its options are: ratio, first_ratio, stages, sample_size, adapt, stage_period, exact_below"
    )


@pytest.mark.parametrize(
    "make,meant",
    [
        (lambda p: gradsift.DeMo(p, chunks=32), "chunk"),
        (lambda p: gradsift.DistributedLion(p, agregate="mean"), "aggregate"),
    ],
)
def test_the_optimizers_that_exchange_name_the_option_a_misspelt_one_meant(make, meant: str) -> None:
    message = refusal(lambda: make(torch.nn.Linear(3, 2).parameters()))
    assert f"(did you mean {meant}?); its options are: " in message


def test_a_choice_names_the_one_a_misspelt_value_meant() -> None:
    from gradsift.core.validation import check_choice

    policies = ("propagate", "skip", "raise")
    assert check_choice("skip", "nonfinite", policies) == "skip"
    assert refusal(lambda: check_choice("Skp", "nonfinite", policies)) == (
        "nonfinite must be one of propagate, skip, raise; got 'Skp' (did you mean 'skip'?)"
    )
    assert refusal(lambda: check_choice("zzz", "nonfinite", policies)).endswith("got 'zzz'")
    assert refusal(lambda: check_choice(3, "nonfinite", policies)).endswith("got 3")
