"""How ``compressor="auto"`` hands the run from one method to another (:mod:`gradsift.hook.auto`).

Entering a method: its hook state is built as ``register_comm_hook(ddp, name, optimizer=...)``
would build it with the steps before as its dense warm-up, on the optimizer already found;
under SGD with momentum correction its velocity starts from SGD's momentum buffers (the
run's momentum so far). Leaving one with error feedback for a stateless one: the workers'
means of its velocity and residual go back to the optimizer -- SGD's momentum buffer and
one application of the residual (:func:`gradsift.hook.recipe.give_back`), or AdamW's moments
at the steps it missed (:meth:`~gradsift.hook.adam.FrozenVarianceStep.give_back`).
"""

from typing import Any

from gradsift.hook import recipe
from gradsift.hook.adam import FrozenVarianceStep
from gradsift.hook.state import GradsiftHookState


def enter(
    ddp_model: Any,
    dense: GradsiftHookState,
    name: str,
    options: dict[str, Any],
    hook_options: dict[str, Any],
    step: int,
) -> GradsiftHookState:
    """A hook state of method ``name`` (compressor ``options``, ``hook_options``) taking the run
    over at ``step`` from the ``dense`` state: its optimizer and scaler adopted."""
    hook_options = {**hook_options, "warmup_steps": step}
    if hook_options.get("scaler") is None:
        hook_options["scaler"] = dense.options.scaler
    state = GradsiftHookState.build(name, **options, **hook_options, process_group=dense.process_group)
    state.attach(ddp_model, dense.optimizer)  # under SGD its velocity starts from SGD's momentum buffers
    for checks in _checks(state):  # what a named method refuses, auto leaves the method for
        checks.refuse = False
    state.find_optimizer = False  # the dense state's, adopted above
    # a scaler is looked for at its first bucket, unless the dense state has looked already
    state.discovering = state.options.scaler is None and dense.discovering
    state.earlier_scalers = dense.earlier_scalers  # those alive when the hook was registered
    return state


def found_unfollowable(running: GradsiftHookState) -> str | None:
    """What ``running``'s checks found, at the optimizer step just taken, that a method with a
    takeover cannot follow -- clipping after its exchange (:mod:`gradsift.hook.first_step`), several
    exchanges per optimizer step, a momentum changed, another optimizer (:mod:`gradsift.hook.taken_over`)
    --, each finding read once (None: nothing): ``auto`` then runs stock DDP, as the script would
    train without the hook, and never picks that method again."""
    found = [checks.found for checks in _checks(running) if checks.found]
    for checks in _checks(running):
        checks.found = None
    return found[0] if found else None


def found_added_groups(running: GradsiftHookState) -> str | None:
    """At a step's first bucket, before ``running`` exchanges: what it cannot follow among the
    parameter groups added since its last step
    (:meth:`~gradsift.hook.taken_over.TakenOverChecks.follow_added_groups`, which takes over the
    others), or None: ``auto`` then runs stock DDP from this step."""
    if running.taken_over is None:
        return None
    running.taken_over.follow_added_groups()
    return found_unfollowable(running)


def _checks(state: GradsiftHookState) -> list[Any]:
    """The state's checks that refuse or record what its takeover cannot follow."""
    return [checks for checks in (state.first_step, state.taken_over) if checks is not None]


def leave(running: GradsiftHookState, dense: GradsiftHookState) -> None:
    """Give ``running``'s error feedback back to the optimizer before a stateless method runs,
    the workers' means of it (module docstring), and end the checks of its takeover
    (:mod:`gradsift.hook.taken_over`)."""
    assert running.feedback is not None
    if running.taken_over is not None:  # the takeover ends here: so do its per-step checks
        running.taken_over.detach()
    means = running.feedback.workers_mean(dense.layout.numels, dense.process_group)
    adam = running.adam
    if isinstance(adam, FrozenVarianceStep):  # Adam's moments, at the steps it missed
        adam.give_back(*means, steps=running.ledger.step - (adam.warmup_end or 0))
    else:
        recipe.give_back(dense.optimizer, dense.layout.numbers, *means)
