"""Checkpoint the hook's state of every rank in one file, and check replicas before saving.

The hook's state is *per rank*: each worker keeps its own error-feedback residuals
(what it has not sent yet), compressor adaptation state and RNG stream, while model and
optimizer states are replicated. The usual pattern -- rank 0 writes one checkpoint --
therefore needs every rank's hook state gathered to rank 0 (:func:`gather_hook_states`,
a collective) and, on resume, each rank picking its own entry (:func:`load_hook_state`).
Resuming on a different number of workers is refused: residuals belong to a rank.

Gathered states travel as plain data (tensors, numbers, strings and containers of them;
:mod:`gradsift.core.plain`), never as pickled objects, and are saved on the CPU. Load the
file with ``torch.load(path, map_location="cpu", weights_only=True)`` (or
:func:`gradsift.core.plain.read_plain`); :func:`load_hook_state` puts this rank's entry on
its device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsift.core.collectives import blocking, collective_device
from gradsift.core.errors import InvalidOptionError, UntrustedDataError
from gradsift.core.plain import PLAIN, plain_bytes, read_plain
from gradsift.core.validation import check_int
from gradsift.hook.checkpoint_checks import check_hook_entry
from gradsift.hook.handshake import hook_settings

#: Elements per step of :func:`parameter_digest`: its float64 temporaries are this long.
DIGEST_CHUNK = 1 << 20


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside its dicts, lists and tuples on the CPU (other
    values as they are): what a checkpoint should hold, whatever device made it."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def _to_device(value: Any, device: torch.device, floating_only: bool) -> Any:
    """``value`` with its tensors on ``device``; with ``floating_only`` the other tensors
    (RNG states, counters) go to the CPU instead, where torch reads them."""
    if isinstance(value, torch.Tensor):
        return value.to(device if value.is_floating_point() or not floating_only else "cpu")
    if isinstance(value, dict):
        return {key: _to_device(item, device, floating_only) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device, floating_only) for item in value)
    return value


def hook_state_on(state_dict: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """One rank's ``GradsiftHookState.state_dict()`` placed for a hook on ``device``.

    The state store (residuals, velocities, VGC's accumulators, exchange bounds) meets the
    gradients: all of it goes to ``device``. In the compressor's state the floating-point
    tensors (PowerSGD's P/Q memories) go to ``device`` and every other tensor to the CPU:
    those are RNG states, and ``torch.Generator.set_state`` takes only a CPU ``ByteTensor``.
    """
    device = torch.device(device)
    placed = dict(state_dict)
    placed["store"] = _to_device(state_dict["store"], device, floating_only=False)
    placed["compressor"] = _to_device(state_dict["compressor"], device, floating_only=True)
    return placed


def gather_hook_states(state: Any, group: Any = None, dst: int = 0) -> dict[str, Any] | None:
    """Collective: rank ``dst`` (of ``group``) receives ``{"world_size": W, "ranks": [sd_0, ..., sd_{W-1}],
    "settings": ...}``.

    ``sd_r`` is rank r's ``state.state_dict()`` with every tensor on the CPU (:func:`to_cpu`);
    ``settings`` the hook's (:func:`gradsift.hook.handshake.hook_settings`: the compressor's
    name and options, the hook's options -- the same on every rank), which
    :func:`load_hook_state` compares with the hook it loads into. Every other rank gets
    ``None``. Every rank of ``group`` must call this.

    The states travel as plain data (:mod:`gradsift.core.plain`), never as pickled objects:
    each rank checks its own state and sends the bytes ``torch.save`` writes in a ``uint8``
    tensor (one all_gather of the sizes, one gather of the bytes); rank ``dst`` reads each
    with ``torch.load(weights_only=True)``, so a peer's bytes that hold any other object are
    refused (:class:`~gradsift.core.errors.UntrustedDataError`) without being built. A rank
    whose own state is not plain data says so in the sizes' exchange, and every rank raises.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = collective_device(group)
    refusal: UntrustedDataError | None = None
    try:
        local = plain_bytes(to_cpu(state.state_dict()), f"rank {rank}'s hook state")
    except UntrustedDataError as error:
        local, refusal = torch.zeros(0, dtype=torch.uint8), error
    sizes = _all_gather_sizes(-1 if refusal is not None else local.numel(), group, device)
    refused = [r for r, size in enumerate(sizes) if size < 0]
    if refusal is not None:
        raise refusal
    if refused:
        raise UntrustedDataError(
            f"the hook state of rank(s) {refused} is not plain data ({PLAIN}), so nothing was gathered; "
            "their error names the entry"
        )
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: local.numel()] = local.to(device)
    received = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    blocking(
        "hook state gather",
        group,
        lambda: dist.gather(padded, received, group=group, group_dst=dst, async_op=True),
    )
    if received is None:
        return None
    ranks = [
        read_plain(bytes_[:size], f"rank {r}'s hook state")
        for r, (bytes_, size) in enumerate(zip(received, sizes, strict=True))
    ]
    return {"world_size": world, "ranks": ranks, "settings": hook_settings(state)}


def _all_gather_sizes(size: int, group: Any, device: torch.device) -> list[int]:
    """Collective: every rank's ``size``, in rank order."""
    local = torch.tensor([size], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    blocking(
        "hook state sizes all_gather",
        group,
        lambda: dist.all_gather(sizes, local, group=group, async_op=True),
    )
    return [int(size) for size in torch.cat(sizes).tolist()]


def load_hook_state(
    state: Any, saved: dict[str, Any], group: Any = None, device: torch.device | str | None = None
) -> None:
    """Restore this rank's entry of :func:`gather_hook_states`' result into ``state``.

    ``saved`` may come from ``torch.load(path, map_location="cpu", weights_only=True)``: the
    entry is checked (:func:`gradsift.hook.checkpoint_checks.check_hook_entry`: the saved
    settings are this hook's; finite residuals of this model's shapes; step, capacities and
    counts in range), then placed for a hook on ``device`` (:func:`hook_state_on`), the
    device of the model's parameters, and loaded; a refused entry leaves ``state`` as it
    was. None takes :func:`collective_device`: the current CUDA device under NCCL, else the
    CPU; pass ``device`` when the model lives elsewhere (CUDA tensors over gloo, say).
    """
    entry = rank_entry(saved, group)
    where = f"the checkpoint's hook state of rank {dist.get_rank(group)}"
    placed_on = collective_device(group) if device is None else device
    restore_hook_state(state, entry, saved.get("settings"), placed_on, where)


def restore_hook_state(
    state: Any, entry: Any, settings: dict[str, str] | None, device: torch.device | str, where: str
) -> None:
    """Check one rank's saved hook state against ``state`` (and the ``settings`` saved with
    it; None for a checkpoint older than them), place it on ``device`` and load it, all or
    nothing: a refused entry raises :class:`InvalidOptionError` naming what is wrong, and a
    load that fails half-way puts the state back as it was."""
    check_hook_entry(state.prepare_load(entry), entry, settings, where)  # after discovery, auto's switch
    before = state.state_dict()
    try:
        state.load_state_dict(hook_state_on(entry, device))
    except Exception:
        state.load_state_dict(before)
        raise


def rank_entry(saved: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """This rank's state dict in :func:`gather_hook_states`' result, after checking that
    ``saved`` is such a result, made by a run of this world size."""
    if not isinstance(saved, dict) or "ranks" not in saved or "world_size" not in saved:
        raise InvalidOptionError(
            "saved must be the dict gather_hook_states returned (keys world_size, ranks)"
        )
    check_same_world_size(saved["world_size"], group)
    entry: dict[str, Any] = saved["ranks"][dist.get_rank(group)]
    return entry


def check_same_world_size(saved_world_size: int, group: Any = None) -> None:
    """Refuse a hook state saved by a run of another size: residuals belong to a rank."""
    world = dist.get_world_size(group)
    if saved_world_size != world:
        raise InvalidOptionError(
            f"checkpoint holds the hook state of {saved_world_size} ranks, this run has world_size={world}; "
            "error-feedback residuals belong to a rank, so resume with the same number of workers"
        )


def parameter_digest(module: torch.nn.Module, chunk: int = DIGEST_CHUNK) -> torch.Tensor:
    """``(sum p_i, sum i * p_i, sum p_i^2)`` in float64 over ``module``'s parameters
    flattened and concatenated (``i`` counts from 1), on the first parameter's device.

    Computed ``chunk`` elements at a time -- each chunk's positions start at its offset in
    the concatenation -- so the float64 temporaries stay ``chunk`` long (a whole 7B-parameter
    model in float64 would take 56 GB, and its positions as much again).
    """
    check_int(chunk, "chunk", low=1)
    parameters = [p.detach() for p in module.parameters()]
    if not parameters:
        raise InvalidOptionError(f"{type(module).__name__} has no parameters to compare")
    digest = torch.zeros(3, dtype=torch.float64, device=parameters[0].device)
    offset = 0
    for parameter in parameters:
        flat = parameter.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk].to(torch.float64)
            first = offset + start + 1
            positions = torch.arange(first, first + part.numel(), dtype=torch.float64, device=part.device)
            sums = torch.stack([part.sum(), torch.dot(part, positions), torch.dot(part, part)])
            digest += sums.to(digest.device)
        offset += flat.numel()
    return digest


def parameters_agree(module: torch.nn.Module, group: Any = None) -> bool:
    """Collective: True when every rank holds bit-identical parameters.

    Compares :func:`parameter_digest` across ranks (one small all_gather on the
    parameters' device, which NCCL needs), so a diverged replica -- e.g. after an
    optimizer step on unsynchronised gradients -- is caught before it is saved.
    """
    digest = parameter_digest(module)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    blocking("digest all_gather", group, lambda: dist.all_gather(digests, digest, group=group, async_op=True))
    return all(torch.equal(d, digests[0]) for d in digests)
