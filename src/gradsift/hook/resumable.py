"""What a checkpoint's hook state must share with the hook that loads it.

A hook state holds one method's state: its residuals and tables in the store, its counters
and generators. Another method would load it without an error wherever the names happen to
fit (top-k's residual into EF-signSGD's, VGC's tables into the store of ``none``) and go on
from state that is not its own. :func:`check_resumable` refuses that, and a checkpoint made
with error feedback on where the hook has it off (or the other way), another momentum, or
another ``server_feedback``, and a state another worker saved (:mod:`gradsift.core.worker_state`:
its residuals are that worker's). The options of one method may change across a resume (a new
ratio, say); the documented helpers (:mod:`gradsift.integrations.checkpoint`) check every
setting on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.core.worker_state import check_worker
from gradsift.hook.feedback import ErrorFeedback
from gradsift.hook.layout import ParameterLayout
from gradsift.hook.options import HookOptions

#: How to save every rank's hook state, named when a rank loads another's.
EVERY_RANK = (
    "save every rank's with gradsift.integrations.checkpoint.gather_hook_states and load this rank's with "
    "load_hook_state (docs/integrations.md), or write each rank's state.state_dict() to a file of its own"
)


def check_resumable(
    saved: Mapping[str, Any],
    compressor: Compressor,
    feedback: ErrorFeedback | None,
    options: HookOptions,
    layout: ParameterLayout,
    group: Any = None,
) -> None:
    """Raise :class:`InvalidOptionError` unless ``saved`` (a hook's ``state_dict()``) was made by
    this worker of ``group`` (:func:`~gradsift.core.worker_state.check_worker`), by ``compressor``
    (its name: a checkpoint older than the name is not checked for it), with error feedback of
    ``feedback``'s momentum (None: without error feedback) and ``options.server_feedback``, and,
    once ``layout`` numbers a model, for its parameters' memory orders (:func:`check_orders`)."""
    check_worker(saved.get("worker"), group, "the hook state", EVERY_RANK)
    if layout.numels:
        check_orders(saved.get("orders"), layout.orders)
    method, momentum = compressor.name, None if feedback is None else feedback.momentum
    server_feedback = options.server_feedback
    made = saved.get("method")
    if made is not None and made != method:
        raise InvalidOptionError(
            f"the checkpoint's hook state was made by compressor {made!r}, and this hook runs {method!r}: "
            f"its state (residuals, counters) belongs to {made!r}; register the hook with {made!r} to resume"
        )
    if (saved["feedback"] is None) != (momentum is None):
        raise InvalidOptionError(
            "checkpoint and hook disagree on error feedback (on in one, off in the other)"
        )
    if momentum is not None and float(saved["feedback"]["momentum"]) != momentum:
        raise InvalidOptionError(
            f"checkpoint was made with momentum={saved['feedback']['momentum']}, this hook has {momentum}"
        )
    if bool(saved.get("server_feedback", False)) != server_feedback:
        raise InvalidOptionError(
            "checkpoint and hook disagree on server_feedback (on in one, off in the other): the "
            "server residual would be dropped or start from zero"
        )


def check_orders(saved: Any, ours: dict[int, list[int]]) -> None:
    """Refuse a state saved with a parameter in another memory order than this model's
    (:mod:`gradsift.core.bucket_order`: its flat tensors would meet other elements); None: not
    known (a checkpoint older than the record)."""
    if saved is None:
        return
    if not isinstance(saved, dict) or not all(
        type(n) is int and isinstance(o, list) for n, o in saved.items()
    ):
        raise InvalidOptionError(
            f"the hook state's orders must map parameter numbers to lists, got {saved!r}"
        )
    for number in sorted(set(saved) | set(ours)):
        if saved.get(number) != ours.get(number):
            raise InvalidOptionError(
                f"the hook state's parameter {number} was saved in memory order {saved.get(number) or 'row-major'} "
                f"and is in {ours.get(number) or 'row-major'} here (channels_last or not): the state holds each "
                "parameter in the order DDP's bucket does; convert the model as it was saved "
                "(model.to(memory_format=...)) before wrapping it in DDP"
            )
