"""gradsift's exchange for FSDP models: what FSDP lets a hook replace, and nothing else.

``gradsift.register_comm_hook(model, compressor, **options)`` lands here when ``model``
is an FSDP1 ``FullyShardedDataParallel`` or an FSDP2 ``fully_shard`` module. What a
hook can take over depends on the flavour (torch 2.13, every path runs on gloo/CPU):

* **FSDP1, ``NO_SHARD``** -- FSDP hands the hook each unit's full flat gradient
  ``g`` (``hook(state, g)``) instead of its ``allreduce(g) / W``. gradsift runs its DDP
  hook on it, the unit standing for one DDP bucket: error feedback ``c = g + r``,
  compress, the compressor's exchange (allgather, balanced, shared-mask, allreduce),
  ``r <- c - s``, the per-step transaction, the non-finite policy. Every compressor
  but the ones that run their own collectives (PowerSGD) or read parameters (VGC).
  The optimizer is the DDP hook's too: ``optimizer=`` (or, left out, the one found holding
  the units' flat parameters, :mod:`gradsift.hook.discovery`) gets SGD's momentum
  correction or the Adam methods (:mod:`gradsift.hook.adam`), each unit's ``FlatParameter``
  standing for the parameters of a DDP bucket: the optimizer must hold the flat parameters
  (``use_orig_params=False``, FSDP1's default), as it does then.
* **FSDP1, ``FULL_SHARD`` / ``SHARD_GRAD_OP``** -- the hook gets the padded flat
  gradient and the shard it must fill (``hook(state, g, out)``): a reduce-scatter of
  elementwise sums (:class:`gradsift.exchanges.reduce_scatter.ReduceScatter`). gradsift
  sends the gradient cast by ``fp16``/``bf16`` (or as is: ``none``):
  ``out <- reduce_scatter(cast(g) / W)`` in the cast dtype, back in the gradient's
  dtype -- half the bytes. Sparse payloads do not add up elementwise, so they are
  refused here.
* **FSDP1, hybrid strategies** -- ``register_comm_hook`` refuses hooks for
  ``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` (an ``AssertionError`` in FSDP itself).
* **FSDP2 (``fully_shard``) on a 1-D mesh plus ``process_group=`` the replicate
  group** -- hybrid sharding with gradsift on the inter-node part: FSDP reduce-scatters
  within the shard mesh (intra-node), then calls the module's all-reduce hook
  (``set_all_reduce_hook``) with its reduced shard ``g`` (the intra-node mean); the hook
  replaces ``g`` by the mean over the replicate group, exactly like ``NO_SHARD`` above
  (compressed, error feedback on ``g``). On a 2-D (native HSDP) mesh FSDP2 has already
  all-reduced across replicas before the hook runs, so gradsift refuses it; a plain
  1-D FSDP2 model without ``process_group`` has no allreduce to compress. ``optimizer=`` is
  refused: the hook sees each module's reduced shard, the optimizer steps the DTensor
  parameters, and the takeovers need the one to stand for the other.

Every exchange is synchronous within its hook (FSDP reads the result as soon as the
hook returns), and a non-finite step's fill is applied there on the device from the
exchange's flag; the step still closes when backward ends (:mod:`gradsift.hook.ledger`), which
reads the step's checks, raises a peer failure or, under ``nonfinite="raise"``, the
non-finite error. The
returned :class:`~gradsift.hook.state.GradsiftHookState` is the DDP hook's: ``stats()``,
``state_dict()`` / ``load_state_dict()`` (residuals keyed by unit number, in
``FSDP.fsdp_modules`` / module order) behave as for DDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeGuard, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from gradsift.compressors.base import Compressor
from gradsift.compressors.casts import Cast
from gradsift.core.collectives import ready
from gradsift.core.errors import GradsiftError, InvalidOptionError
from gradsift.core.finite import fill_where
from gradsift.core.parts import Outcome, Part
from gradsift.exchanges.base import wait_timed
from gradsift.exchanges.choice import exchange_class
from gradsift.exchanges.reduce_scatter import ReduceScatter
from gradsift.hook.handshake import check_hook_settings
from gradsift.hook.layout import FlatBucket
from gradsift.hook.ledger import BucketInFlight
from gradsift.hook.options import HookOptions
from gradsift.hook.route import exchange_now
from gradsift.hook.state import GradsiftHookState

_REDUCE_SCATTER = ReduceScatter()

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
#: Hook options that need the model's parameters, which FSDP flattens or shards.
_REFUSED = ("clip_norm",)
#: Where ``optimizer=`` (momentum correction, the Adam methods) applies.
_OPTIMIZER_WORKS = (
    "optimizer= (SGD's momentum correction, the Adam/AdamW methods) works on DDP and on FSDP1 "
    "NO_SHARD with use_orig_params=False (the default), where each unit's flat parameter is what "
    "the optimizer steps"
)
#: The hook options the sharded strategies' reduce-scatter honours; every other one must keep its default.
_SHARDED_FREE_OPTIONS = ("nonfinite", "log_every", "jsonl_path")
_SUPPORTED = (
    "gradsift supports: FSDP1 NO_SHARD with any compressor but powersgd and vgc; FSDP1 FULL_SHARD/"
    "SHARD_GRAD_OP with none, fp16 or bf16; FSDP2 fully_shard on a 1-D (intra-node) mesh with "
    "process_group=<the replicate group> with any compressor but powersgd and vgc"
)


def is_fsdp_model(model: object) -> TypeGuard[FSDP | FSDPModule]:
    """True for an FSDP1 ``FullyShardedDataParallel`` or an FSDP2 ``fully_shard`` module."""
    return isinstance(model, (FSDP, FSDPModule))


@dataclasses.dataclass
class Binding:
    """What FSDP1 hands its hook as ``state``: gradsift's state and the units' flat parameters
    (``units[i]`` is unit ``i`` of the state's layout)."""

    state: GradsiftHookState
    units: list[torch.nn.Parameter]

    def unit_of(self, grad: torch.Tensor) -> torch.nn.Parameter:
        """The FSDP1 unit whose ``FlatParameter`` holds ``grad`` (NO_SHARD hands its ``.grad``)."""
        for unit in self.units:
            if unit.grad is grad:
                return unit
        raise GradsiftError("an FSDP hook got a gradient of no unit of the model it was registered on")


def register_fsdp_comm_hook(
    model: FSDP | FSDPModule,
    compressor: str | Compressor | GradsiftHookState = "sidco-exp",
    **options: Any,
) -> GradsiftHookState:
    """Install gradsift on an FSDP model (see the module docstring for what each flavour allows).

    Options are the DDP hook's (:data:`gradsift.hook.options.HOOK_OPTIONS`), except
    ``clip_norm`` and ``granularity="layer"`` (they need the model's parameters, which FSDP
    flattens or shards); ``optimizer`` applies on FSDP1 ``NO_SHARD`` only (the module
    docstring), where it is looked for when left out, as on DDP. ``process_group`` is, for FSDP2, the group gradsift
    all-reduces over (required: the replicate group); FSDP1 uses the model's own group.

    Example::

        model = FullyShardedDataParallel(module, sharding_strategy=ShardingStrategy.NO_SHARD)
        state = gradsift.register_comm_hook(model, "topk", ratio=0.01)  # lands here

        # or FSDP2: fully_shard within each node, gradsift across the nodes
        mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
        fully_shard(module, mesh=mesh["shard"])
        replicas = mesh.get_group("replicate")
        state = gradsift.register_comm_hook(module, "topk", ratio=0.01, process_group=replicas)
    """
    optimizer = options.pop("optimizer", None)
    state = GradsiftHookState.resolve(compressor, options, _REFUSED, f"on FSDP models; {_SUPPORTED}")
    if state.options.granularity != "bucket":
        raise InvalidOptionError(
            f"granularity must be 'bucket' on FSDP models (one part per FSDP unit); {_SUPPORTED}"
        )
    if state.options.adam == "zero-one":
        raise InvalidOptionError(
            "adam='zero-one' lets DDP replicas step apart between synchronisations; on FSDP models use "
            f"adam='frozen-variance' or 'onebit'; {_SUPPORTED}"
        )
    if isinstance(model, FSDP):
        _register_fsdp1(model, state, optimizer)
    else:
        _refuse_optimizer(optimizer, "fully_shard (FSDP2)")
        _register_fsdp2(cast(torch.nn.Module, model), state)  # fully_shard modules are nn.Modules
    check_hook_settings(state, "register_comm_hook on an FSDP model")  # collective, before any step
    return state


# -- FSDP1 ----------------------------------------------------------------------------------
def _register_fsdp1(model: FSDP, state: GradsiftHookState, optimizer: Any) -> None:
    strategies = {unit.sharding_strategy for unit in FSDP.fsdp_modules(model)}
    if len(strategies) != 1:
        names = sorted(s.name for s in strategies)
        raise InvalidOptionError(f"FSDP units use several sharding strategies {names}; {_SUPPORTED}")
    strategy = strategies.pop()
    if strategy in _HYBRID:
        raise InvalidOptionError(
            f"FSDP1 refuses communication hooks for {strategy.name} (torch {torch.__version__}); "
            f"for hybrid sharding use FSDP2: {_SUPPORTED}"
        )
    replicas = getattr(model, "_inter_node_pg", None)  # set only by the hybrid strategies
    if replicas is not None and dist.get_world_size(replicas) > 1 and strategy not in _HYBRID:
        raise InvalidOptionError(
            f"this FSDP1 model was built with a hybrid strategy over a 1-rank shard group, which FSDP "
            f"turns into {strategy.name} over that group alone: its gradients are never all-reduced "
            f"across the {dist.get_world_size(replicas)} replicas (torch {torch.__version__}); {_SUPPORTED}"
        )
    if state.process_group is not None and state.process_group is not model.process_group:
        raise InvalidOptionError(
            "process_group must be left out for FSDP1 models (the model's own group is used)"
        )
    state.process_group = model.process_group
    flat_params: list[torch.nn.Parameter] = [
        unit._flat_param for unit in FSDP.fsdp_modules(model) if unit._flat_param is not None
    ]
    binding = Binding(state, flat_params)
    if strategy == ShardingStrategy.NO_SHARD:
        _check_allreduce_compressor(state.compressor)
        state.layout.bind(torch.nn.ParameterList(flat_params))
        _check_holds(optimizer, flat_params)
        state.watch(flat_params, optimizer)
        model.register_comm_hook(binding, _no_shard_hook)
    else:
        _refuse_optimizer(optimizer, strategy.name)
        _check_reduce_scatter_options(state, strategy)
        model.register_comm_hook(binding, _reduce_scatter_hook)


def _refuse_optimizer(optimizer: Any, where: str) -> None:
    if optimizer is not None and optimizer is not False:
        raise InvalidOptionError(f"optimizer= is not supported on {where}: {_OPTIMIZER_WORKS}; {_SUPPORTED}")


def _check_holds(optimizer: Any, flat_params: Sequence[torch.nn.Parameter]) -> None:
    """An optimizer passed for ``NO_SHARD`` must step the units' flat parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # None / False, or not an optimizer (the takeover names the type)
    wanted = {id(p) for p in flat_params}
    if not any(id(p) in wanted for group in optimizer.param_groups for p in group["params"]):
        raise InvalidOptionError(
            f"the optimizer steps none of this FSDP model's flat parameters (built with "
            f"use_orig_params=True, or for another model?): {_OPTIMIZER_WORKS}; {_SUPPORTED}"
        )


def _no_shard_hook(binding: Binding, grad: torch.Tensor) -> None:
    """FSDP1 ``NO_SHARD``: replace one unit's full gradient by gradsift's mean over the ranks."""
    exchange_unit(binding.state, binding.unit_of(grad), grad)


def _reduce_scatter_hook(binding: Binding, grad: torch.Tensor, output: torch.Tensor) -> None:
    """FSDP1 sharded strategies: ``output <- reduce_scatter(cast(grad) / W)`` in the cast dtype
    (:class:`ReduceScatter`), waited for at once; a non-finite step gets the ``nonfinite``
    policy's fill on the device."""
    state = binding.state
    step = state.open_step()
    parts = [Part(0, 0, grad, [])]
    context = state.context(output, parts, step.readout, source=grad)
    outcome = wait_timed(context.record, _REDUCE_SCATTER.start(parts, state.codec, context), output.device)
    _fill_if_nonfinite(state, output, outcome)
    step.buckets.append(BucketInFlight(torch.futures.Future(), ready(outcome), output, context.record))


# -- FSDP2 ----------------------------------------------------------------------------------
def _register_fsdp2(model: torch.nn.Module, state: GradsiftHookState) -> None:
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        mesh = _mesh_of(module)
        if mesh is not None and mesh.ndim != 1:
            raise InvalidOptionError(
                f"fully_shard on a {mesh.ndim}-D mesh (native HSDP) all-reduces across replicas before any "
                f"hook runs; shard on the 1-D intra-node mesh instead: {_SUPPORTED}"
            )
    if state.process_group is None:
        raise InvalidOptionError(
            "a fully_shard model reduce-scatters its gradients inside FSDP (use its "
            "MixedPrecisionPolicy(reduce_dtype=...) for 16-bit traffic); gradsift compresses the "
            f"all-reduce across replicas: pass process_group=<the replicate group>; {_SUPPORTED}"
        )
    _check_allreduce_compressor(state.compressor)
    units = [_placeholder(_reduced_numel(module, modules)) for module in modules]
    state.layout.bind(torch.nn.ParameterList(units))
    for module, unit in zip(modules, units, strict=True):
        try:
            module.set_all_reduce_hook(_ReplicateHook(state, unit))
        except ValueError as error:
            raise InvalidOptionError(f"FSDP2 refused the all-reduce hook: {error}") from error


@dataclasses.dataclass
class _ReplicateHook:
    """FSDP2's all-reduce hook of one module: its reduced shard -> the mean over the replicas."""

    state: GradsiftHookState
    unit: torch.nn.Parameter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.numel() != self.unit.numel():
            raise GradsiftError(
                f"FSDP2 handed the all-reduce hook {reduce_output.numel()} elements, expected "
                f"{self.unit.numel()}: a parameter of this module that requires a gradient got none in "
                "this backward (FSDP2 leaves it out; module.set_reduce_scatter_unused_params(True) "
                "reduces a zero gradient for it, as DDP's find_unused_parameters), or requires_grad "
                "changed after register_comm_hook (register again)"
            )
        exchange_unit(self.state, self.unit, reduce_output)


def _mesh_of(module: torch.nn.Module) -> Any:
    """The device mesh of a ``fully_shard`` module's (DTensor) parameters, or None without any."""
    for param in module.parameters():
        return getattr(param, "device_mesh", None)
    return None


def _reduced_numel(module: torch.nn.Module, fsdp_modules: Sequence[torch.nn.Module]) -> int:
    """Elements of the shard FSDP2 reduces for ``module``: its own parameters that require a
    gradient (not those of a nested ``fully_shard`` module; a frozen one has no gradient to
    reduce), each padded on dim 0 to a multiple of the shard count ``S`` and cut in ``S``:
    ``sum ceil(d0 / S) * prod(other dims)``."""
    nested = {id(p) for m in fsdp_modules if m is not module and _contains(module, m) for p in m.parameters()}
    total = 0
    for param in module.parameters():
        if id(param) in nested or not param.requires_grad:
            continue
        mesh = getattr(param, "device_mesh", None)
        shards = 1 if mesh is None else mesh.size()
        shape = tuple(param.shape) or (1,)
        rows = -(-shape[0] // shards)
        total += rows * int(torch.Size(shape[1:]).numel())
    return total


def _contains(module: torch.nn.Module, other: torch.nn.Module) -> bool:
    return any(m is other for m in module.modules())


def _placeholder(numel: int) -> torch.nn.Parameter:
    """A parameter on the meta device (no memory) standing for one FSDP2 unit in the layout."""
    return torch.nn.Parameter(torch.empty(numel, device="meta"), requires_grad=False)


# -- shared ---------------------------------------------------------------------------------
def exchange_unit(state: GradsiftHookState, unit: torch.nn.Parameter, flat: torch.Tensor) -> None:
    """Replace ``flat`` (one unit's gradient) in place by gradsift's mean over the ranks.

    Runs the DDP hook on the unit as one bucket and waits for its exchange; a step whose
    gradient is non-finite on some rank gets the ``nonfinite`` policy's fill right away
    (FSDP consumes ``flat`` when the hook returns, before the step closes).
    """
    flat = flat.view(-1)  # FSDP's flat gradients are 1-D already: the same tensor
    mean, outcome = exchange_now(state, FlatBucket(flat, [unit]))
    if mean is not flat:
        flat.copy_(mean)
    _fill_if_nonfinite(state, flat, outcome)


def _fill_if_nonfinite(state: GradsiftHookState, result: torch.Tensor, outcome: Outcome) -> None:
    """The ``nonfinite`` policy's fill where the outcome's flag says so (no host read on a device)."""
    if outcome.nonfinite:
        fill_where(result, torch.stack(outcome.nonfinite).any(), state.ledger.fill_value)


def _check_allreduce_compressor(compressor: Compressor) -> None:
    if compressor.needs_parameters or any(exchange_class(name).whole_bucket for name in compressor.exchanges):
        raise InvalidOptionError(
            f"compressor {compressor.name!r} is not supported on FSDP models; {_SUPPORTED}"
        )


def _check_reduce_scatter_options(state: GradsiftHookState, strategy: ShardingStrategy) -> None:
    if not isinstance(state.compressor, Cast):
        raise InvalidOptionError(
            f"{strategy.name} reduce-scatters its gradients, so only elementwise casts can travel: "
            f"compressor {state.compressor.name!r} is not supported there (use NO_SHARD); {_SUPPORTED}"
        )
    defaults = HookOptions()
    changed = [
        field.name
        for field in dataclasses.fields(HookOptions)
        if field.name not in _SHARDED_FREE_OPTIONS
        and getattr(state.options, field.name) != getattr(defaults, field.name)
    ]
    if changed:
        raise InvalidOptionError(
            f"hook options {changed} do not apply to {strategy.name}'s reduce-scatter (only "
            f"{', '.join(_SHARDED_FREE_OPTIONS)} do); {_SUPPORTED}"
        )
