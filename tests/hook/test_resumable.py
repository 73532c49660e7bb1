"""``gradsift.hook.resumable``: a hook loads only a checkpoint of its own method.

Oracle: the registry's names. Before the check, 15 of 132 loads between twelve methods were
taken without an error (top-k's residual into EF-signSGD's store, VGC's tables into ``none``'s).
"""

from __future__ import annotations

import pytest

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.state import GradsiftHookState

REQUIRED = {"threshold": {"threshold": 0.1}}  # options without a default


def state_of(name: str, **options: object) -> GradsiftHookState:
    return GradsiftHookState.build(name, **REQUIRED.get(name, {}), **options)


def test_a_checkpoint_loads_only_into_a_hook_of_its_method() -> None:
    names = gradsift.available_compressors()
    saved = {name: state_of(name).state_dict() for name in names}
    for made in names:
        assert saved[made]["method"] == made
        for loading in names:
            hook = state_of(loading)
            if loading == made:
                hook.load_state_dict(saved[made])
                continue
            with pytest.raises(InvalidOptionError, match=f"made by compressor '{made}'.*runs '{loading}'"):
                hook.load_state_dict(saved[made])


def test_the_methods_options_may_change_and_an_older_checkpoint_is_not_asked_for_its_name() -> None:
    saved = state_of("topk", ratio=0.01).state_dict()
    state_of("topk", ratio=0.1).load_state_dict(saved)  # a new density on resume
    del saved["method"]  # a checkpoint from before the name was saved
    state_of("efsignsgd").load_state_dict(saved)
