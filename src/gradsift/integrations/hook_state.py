"""A hook state built before the DDP model exists (for trainers that wrap the model later).

Lightning and Hugging Face's ``Trainer`` create the ``DistributedDataParallel`` wrapper
themselves, after the user has configured the callbacks. Their gradsift callbacks build
the :class:`~gradsift.hook.state.GradsiftHookState` up front -- so a wrong option fails when the
callback is made, not minutes later at the first step -- and bind it to the DDP model
with :func:`gradsift.frontends.ddp.register_comm_hook` once the trainer has wrapped it.
"""

from __future__ import annotations

from typing import Any

from gradsift.compressors.base import Compressor
from gradsift.hook.state import GradsiftHookState


def new_hook_state(compressor: str | Compressor, **options: Any) -> GradsiftHookState:
    """An unattached hook state, from the arguments :func:`gradsift.register_comm_hook` takes.

    ``options`` holds hook options (:data:`gradsift.hook.options.HOOK_OPTIONS`: ``granularity``,
    ``warmup_steps``, ...) and, when ``compressor`` is a registry name, the compressor's
    options (``ratio``, ...).
    """
    return GradsiftHookState.build(compressor, **options)
