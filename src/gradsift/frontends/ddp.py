"""The DDP frontend: ``register_comm_hook(ddp_model, compressor="auto", **options)``.

Builds the hook's state (:class:`~gradsift.hook.state.GradsiftHookState`; for ``"auto"``,
:class:`~gradsift.hook.auto.AutoHookState`, which measures and picks the method), binds it
to the model and its optimizer, and installs the hook, which takes every DDP bucket along
the hook's route (:mod:`gradsift.hook.route`).
"""

from typing import Any

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.auto import AUTO, AutoHookState, auto_hook
from gradsift.hook.compatibility import refuse_sparse_gradients
from gradsift.hook.handshake import check_hook_settings
from gradsift.hook.route import gradsift_hook
from gradsift.hook.state import GradsiftHookState


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    compressor: str | Compressor | GradsiftHookState = AUTO,
    **options: Any,
) -> GradsiftHookState | AutoHookState:
    """Install gradsift's hook on ``ddp_model`` and return its state.

    Args:
        ddp_model: a ``DistributedDataParallel`` model (gloo or NCCL).
        compressor: ``"auto"`` (default: a few measuring steps -- ``sidco-exp`` with momentum
            correction under SGD, stock DDP under other optimizers -- timing the step and each
            candidate's route on this group, then the fastest method that keeps quality for the
            optimizer it found; :mod:`gradsift.hook.auto`), a registry name,
            a :class:`Compressor` instance, or a :class:`GradsiftHookState` to re-attach
            (e.g. one restored by pickle).
        options: the hook's knobs (:data:`~gradsift.hook.options.HOOK_OPTIONS`: ``process_group``, ``optimizer``
            and the fields of :class:`~gradsift.hook.options.HookOptions`); every other keyword goes to the
            compressor (``ratio``, ``stages``, ...). ``optimizer=`` applies DGC's momentum
            correction (:mod:`gradsift.hook.recipe`): with an error-feedback compressor the
            optimizer's momentum and weight decay move into the hook, so momentum is
            applied exactly once (an SGD without momentum keeps its decay). Without
            ``optimizer=`` / ``scaler=`` the hook adopts the optimizer and the ``GradScaler``
            it finds (:mod:`gradsift.hook.discovery`); ``optimizer=False``: none, and none
            looked for.

    The compressor's ``attach(ddp_model.module)`` is called once here. ``torch.compile(ddp_model)``
    may be passed as well: the hook goes on the DDP model it compiles.

    Example::

        model = torch.nn.parallel.DistributedDataParallel(module)
        state = gradsift.register_comm_hook(model)  # "auto"; or e.g. "topk", ratio=0.01
        # train as usual; state.stats()["auto"] says what it chose and why
    """
    ddp_model = getattr(ddp_model, "_orig_mod", ddp_model)  # torch.compile's wrapper: the model it runs
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidOptionError(
            f"ddp_model must be a DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    _refuse_a_second_hook(ddp_model)
    optimizer = options.pop("optimizer", None)
    if isinstance(compressor, str) and compressor == AUTO:
        refuse_sparse_gradients(ddp_model.module, AUTO)
        auto = AutoHookState(ddp_model, optimizer, options)
        check_hook_settings(auto.dense, "register_comm_hook")  # collective: ranks that disagree stop here
        ddp_model.register_comm_hook(auto, auto_hook)
        return auto
    state = GradsiftHookState.resolve(compressor, options)
    refuse_sparse_gradients(ddp_model.module, state.compressor.name)
    state.attach(ddp_model, optimizer)
    check_hook_settings(state, "register_comm_hook")  # collective: ranks that disagree stop here
    ddp_model.register_comm_hook(state, gradsift_hook)
    return state


def _refuse_a_second_hook(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    """DDP takes one communication hook: refuse before the state takes the optimizer over, naming
    the hook there (DDP's ``mixed_precision=`` installs one of its own)."""
    hooks = getattr(ddp_model, "_comm_hooks", [])
    if not hooks:
        return
    name = getattr(hooks[0][0], "__qualname__", type(hooks[0][0]).__name__)
    if name in (gradsift_hook.__qualname__, auto_hook.__qualname__):
        raise InvalidOptionError(
            "gradsift's hook is already registered on this DDP model, which takes one: keep the state "
            "the first register_comm_hook returned (a checkpoint's hook state loads into it)"
        )
    raise InvalidOptionError(
        f"this DDP model already has a communication hook ({name}), and DDP takes one: build the DDP "
        "model without it (DDP's mixed_precision= installs one) and register gradsift's"
    )
