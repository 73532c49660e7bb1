"""What ``compressor="auto"`` chooses among, and the rule it chooses by (:mod:`gradsift.hook.auto`).

The candidates keep the optimizer family's quality (docs/decisions.md, "compressor='auto'"):
SGD -- ``none``, ``bf16``, ``sidco-exp`` at ratio 0.01 with momentum correction; Adam / AdamW
-- ``none``, ``bf16``, and, in a run known to last at least :data:`LONG_RUN_STEPS` steps, the
1-bit Adam method (``efsignsgd`` with the frozen-variance Adam step); another or no optimizer
-- ``none``, ``bf16``, as for an SGD whose groups holding the model's parameters hold others too
(momentum correction would take their momentum: :func:`~gradsift.hook.recipe.foreign_parameters`)
and an optimizer whose momentum a scheduler cycles (:func:`~gradsift.hook.discovery.cycles_momentum`).
The rule (:func:`choose`): each candidate's predicted step is the running method's measured
step with its route exchanged for the candidate's -- the probes' route times less what a probe
counts that the running method's steps did not pay (:mod:`gradsift.hook.paid`) -- and another
method than the preferred one (the dense step at the first decision, the running method at a
re-measure) runs only when predicted :data:`MARGIN` faster than it.

The measuring steps run the family's :data:`START` method: the compressed candidate where
it needs no dense warm-up (SGD's ``sidco-exp``), else ``none``. Why: the two ways to be
wrong cost unequally -- a compressed method measured on a fast link costs its encode for a
few steps, a dense step measured on a slow link costs the whole model's bytes each step
(docs/decisions.md, "auto measures on the compressed method").
"""

from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.spelling import closest, did_you_mean
from gradsift.core.validation import check_int
from gradsift.hook import discovery, recipe
from gradsift.hook.adam import ONE_LINE_WARMUP_STEPS, is_adam

#: A compressed candidate must be predicted this much faster than the dense step.
MARGIN = 0.9
#: The candidates per optimizer family: registry name and compressor options.
CANDIDATES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "sgd": (("none", {}), ("bf16", {}), ("sidco-exp", {"ratio": 0.01})),
    "adam": (("none", {}), ("bf16", {})),
    "other": (("none", {}), ("bf16", {})),
}
#: The method the measuring steps run, per family (module docstring).
START: dict[str, str] = {"sgd": "sidco-exp", "adam": "none", "other": "none"}
#: Under Adam, a run at least this long (``steps=``) also has the 1-bit Adam method.
LONG_RUN_STEPS = 3000
ONE_BIT_ADAM: tuple[str, dict[str, Any]] = ("efsignsgd", {})
#: Hook options ``auto`` passes on to the method it runs (others are the method's own business);
#: ``density_warmup_steps`` goes to the sparsifier it starts with only.
PASSED_ON = ("nonfinite", "scaler", "warmup_steps", "log_every", "jsonl_path", "granularity")
#: The hook options the probe states take (the others log or time the method's warm-up; the
#: scaler is the dense state's, given or found).
PROBED = ("nonfinite", "granularity")
DENSITY_WARMUP = "density_warmup_steps"


def auto_options(options: dict[str, Any]) -> tuple[int | None, int, dict[str, Any]]:
    """``register_comm_hook(ddp, "auto", **options)``'s options, checked: the run's length in
    steps when the caller knows it (``steps``; None: unknown), the start method's density
    warm-up in steps (0: none; timing starts after it), and the hook options left; one that
    belongs to a named method is refused."""
    taken = ("process_group", "steps", DENSITY_WARMUP, *PASSED_ON)
    unknown = sorted(set(options) - set(taken))
    if unknown:  # a misspelt ``compressor=`` lands here too: the default is auto
        hints = [match for name in unknown if (match := closest(name, ("compressor", *taken)))]
        raise InvalidOptionError(
            f"compressor='auto' picks the method and its options; got {', '.join(unknown)}"
            f"{did_you_mean(hints)}, where auto takes {', '.join(taken)} (a method's own options "
            "need compressor=<name>)"
        )
    rest = dict(options)
    run_steps = rest.pop("steps", None)
    if run_steps is not None:
        check_int(run_steps, "steps", low=1)
    density_warmup_steps = rest.pop(DENSITY_WARMUP, None) or 0
    check_int(density_warmup_steps, DENSITY_WARMUP, low=0)
    return run_steps, density_warmup_steps, rest


def family(optimizer: Any, numbers: dict[int, int] | None = None) -> str:
    """The candidates' family of ``optimizer``: ``"adam"``, ``"sgd"`` or ``"other"`` (none found
    too). Given the model's parameters (``numbers``), an SGD or Adam whose settings the hook
    cannot take over (:func:`~gradsift.hook.recipe.takes_over`: a group holding other parameters,
    Nesterov momentum, dampening, ``amsgrad``, ...) or whose momentum a scheduler cycles
    (:func:`~gradsift.hook.discovery.cycles_momentum`) is ``"other"`` as well: no momentum can be
    taken over from it."""
    if optimizer is None:
        return "other"
    inner = recipe.unwrapped(optimizer)
    kind = "adam" if is_adam(inner) else "sgd" if isinstance(inner, torch.optim.SGD) else "other"
    if kind == "other" or numbers is None:
        return kind
    return kind if recipe.takes_over(inner, numbers) and not discovery.cycles_momentum(inner) else "other"


def sgd_momentum(optimizer: Any) -> float:
    """The found SGD's momentum (0 for another optimizer or none), which the probe of a
    momentum-corrected candidate runs at."""
    if family(optimizer) != "sgd":
        return 0.0
    return float(recipe.unwrapped(optimizer).param_groups[0].get("momentum", 0.0))


def dense_steps(optimizer: Any, name: str, hook_options: dict[str, Any]) -> int:
    """Steps candidate ``name`` needs dense before it starts: Adam's warm-up for the 1-bit
    method (``warmup_steps`` of ``hook_options``, unset: :data:`~gradsift.hook.adam.ONE_LINE_WARMUP_STEPS`)."""
    if family(optimizer) != "adam" or name != "efsignsgd":
        return 0
    given = hook_options.get("warmup_steps")
    return ONE_LINE_WARMUP_STEPS if given is None else int(given)


def running_cost(probed: float, paid: float | None) -> float:
    """``k(running)`` of :func:`choose`: the running method's route cost, its probed time
    ``probed`` or, when its steps paid less (``paid``), that."""
    return probed if paid is None else min(probed, paid)


def choose(
    step: float,
    route: dict[str, float],
    running: str = "none",
    prefer: str | None = None,
    paid: float | None = None,
) -> tuple[str, dict[str, float]]:
    """Steps 3-4 of :mod:`gradsift.hook.auto`: the candidate to run and every candidate's predicted
    step time (seconds), from the ``running`` method's measured step time ``step``, each
    candidate's probed route time ``r`` (seconds) and the running method's route as its steps
    paid it, ``paid`` (seconds per step; None: not timed, taken as ``r(running)``).

    ``h = max(r(running) - paid, 0)`` is what a probe counts that a step does not pay (the
    communication backward hides, the waits of ranks sharing cores); each candidate's cost is
    ``k(c) = max(r(c) - h, 0)`` and its step ``T(c) = step - k(running) + k(c)``, so
    ``T(running) = step``; a method other than ``prefer`` (unset: ``running``) must beat
    ``T(prefer)`` by :data:`MARGIN`."""
    prefer = running if prefer is None else prefer
    hidden = route[running] - running_cost(route[running], paid)
    cost = {name: max(seconds - hidden, 0.0) for name, seconds in route.items()}
    compute = max(step - cost[running], 0.0)
    predicted = {name: compute + seconds for name, seconds in cost.items()}
    predicted[running] = step
    names = list(route)
    best = min(names, key=lambda name: (predicted[name], names.index(name)))
    if best != prefer and predicted[best] > MARGIN * predicted[prefer]:
        best = prefer
    return best, predicted
