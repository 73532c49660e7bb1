"""gradsift: make data-parallel PyTorch training communicate less.

Public API (stable)::

    gradsift.available_compressors() -> list[str]
    c = gradsift.get_compressor("sidco-exp", ratio=0.01)
    payload = c.compress(flat_gradient)
    dense = c.decompress(payloads, numel)   # the mean of every worker's payload
    state = gradsift.register_comm_hook(ddp_model, "sidco-exp", ratio=0.01)
    state = gradsift.diloco(model, optimizer)   # every 10 steps, the delta in 4-bit codes
    optimizer = gradsift.DeMo(model.parameters(), lr=1e-3)   # DeMo: DCT top-k, sign steps
    optimizer = gradsift.DistributedLion(model.parameters())   # Lion's signs, 1 bit each
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from gradsift.core.errors import (
    GradsiftError,
    InvalidOptionError,
    InvalidTensorError,
    NonFiniteGradientError,
    PeerFailureError,
    SettingsMismatchError,
    UnknownCompressorError,
    UntrustedDataError,
    WireFormatError,
)

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from gradsift.compressors import (
        Compressor,
        Payload,
        available_compressors,
        get_compressor,
        register_compressor,
    )
    from gradsift.frontends.decoupled_momentum import DeMo
    from gradsift.frontends.diloco import DiLoCoState, diloco
    from gradsift.frontends.distributed_lion import DistributedLion
    from gradsift.hook.auto import AutoHookState
    from gradsift.hook.state import GradsiftHookState

#: The release, written only here (pyproject.toml reads it; CHANGELOG.md has its entry).
__version__ = "0.1.0"

#: Public names defined in :mod:`gradsift.compressors`, which needs torch: imported on first
#: access (PEP 562), so that ``import gradsift`` -- and the ``gradsift`` command before it
#: has read its arguments -- does not load torch (docs/decisions.md, "The command line
#: imports a subcommand's back-end only when it runs").
_FROM_COMPRESSORS = (
    "Compressor",
    "Payload",
    "available_compressors",
    "get_compressor",
    "register_compressor",
)
#: Every lazily imported public name and its module (``DeMo`` is DeMo's optimizer,
#: ``DistributedLion`` Distributed Lion's).
_LAZY = {
    **dict.fromkeys(_FROM_COMPRESSORS, "gradsift.compressors"),
    "DeMo": "gradsift.frontends.decoupled_momentum",
    "DistributedLion": "gradsift.frontends.distributed_lion",
    "DiLoCoState": "gradsift.frontends.diloco",
    "diloco": "gradsift.frontends.diloco",
    "GradsiftHookState": "gradsift.hook.state",
    "AutoHookState": "gradsift.hook.auto",
}


def __getattr__(name: str) -> Any:
    """A name of :data:`_LAZY`, or the ``compressors`` subpackage itself (so
    ``gradsift.compressors.X`` works after a bare ``import gradsift``), imported now and kept in
    the module."""
    if name != "compressors" and name not in _LAZY:
        raise AttributeError(f"module 'gradsift' has no attribute {name!r}")
    module = importlib.import_module(_LAZY.get(name, "gradsift.compressors"))
    value = module if name == "compressors" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names, the lazy ones included, and the ``compressors`` subpackage: what
    completion and ``dir()`` show (not the module's own imports, ``Any`` or ``importlib``)."""
    return sorted({*__all__, "compressors"})


def register_comm_hook(
    ddp_model: DistributedDataParallel | FullyShardedDataParallel | FSDPModule,
    compressor: str | Compressor | GradsiftHookState = "auto",
    **options: Any,
) -> GradsiftHookState | AutoHookState:
    """Install gradsift's communication hook on a ``DistributedDataParallel`` (or FSDP) model.

    The hook's options and their defaults (what each means:
    :class:`gradsift.hook.options.HookOptions`; every other keyword goes to the compressor,
    e.g. ``ratio``)::

        process_group=None (the model's), optimizer=None (the one found stepping the model;
        False: none), granularity='bucket', min_numel=0, warmup_steps=None, value_dtype=None,
        nonfinite='propagate', error_feedback=None, momentum=0.0, momentum_masking=True,
        clip_norm=None, density_warmup_steps=0, density_warmup_start=0.25, exchange='auto',
        scaler=None (the GradScaler found), adam='frozen-variance', local_steps=None,
        warmup_compressor=None, variance_refresh=(), residual_decay=None, server_feedback=False,
        padding_target=None, log_every=0, jsonl_path=None

    Under ``compressor='auto'`` only ``process_group``, ``steps=None`` (the run's length when
    known), ``density_warmup_steps``, ``nonfinite``, ``scaler``, ``warmup_steps``,
    ``log_every``, ``jsonl_path`` and ``granularity`` (:mod:`gradsift.hook.choice`).

    The rest is :func:`gradsift.frontends.ddp.register_comm_hook`'s, imported lazily so
    that ``import gradsift`` does not initialise ``torch.distributed``. An FSDP model
    (``FullyShardedDataParallel`` or ``fully_shard``) goes to
    :func:`gradsift.frontends.fsdp.register_fsdp_comm_hook`, which takes a named method
    (``"auto"`` switches methods on DDP's buckets only).
    """
    from gradsift.frontends.fsdp import is_fsdp_model, register_fsdp_comm_hook

    if is_fsdp_model(ddp_model):
        if compressor == "auto":
            raise InvalidOptionError(
                "compressor='auto' (the default) measures and switches methods on DDP's buckets; on FSDP "
                "name the method: 'sidco-exp' (SGD), 'bf16' or 'none' (register_comm_hook(model, 'sidco-exp'))"
            )
        return register_fsdp_comm_hook(ddp_model, compressor, **options)
    from gradsift.frontends.ddp import register_comm_hook as _register

    return _register(cast("DistributedDataParallel", ddp_model), compressor, **options)  # it checks the type


__all__ = [
    "AutoHookState",
    "Compressor",
    "DeMo",
    "DiLoCoState",
    "DistributedLion",
    "GradsiftError",
    "GradsiftHookState",
    "InvalidOptionError",
    "InvalidTensorError",
    "NonFiniteGradientError",
    "Payload",
    "PeerFailureError",
    "SettingsMismatchError",
    "UnknownCompressorError",
    "UntrustedDataError",
    "WireFormatError",
    "__version__",
    "available_compressors",
    "diloco",
    "get_compressor",
    "register_comm_hook",
    "register_compressor",
]
