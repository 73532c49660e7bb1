"""The hook's state in a ``torch.distributed.checkpoint`` (DCP) checkpoint, each rank its own shard.

Error-feedback residuals, velocities and compressor state differ from rank to rank, so
each rank saves its own entry under its own key, ``gradsift_hook/rank<r>``, beside the
model and the optimizer in the same ``dcp.save`` call; nothing is gathered to one host.
The entry is the rank's ``state.state_dict()`` with the hook's settings
(:func:`gradsift.hook.handshake.hook_settings`) and the world size, as the plain-data bytes
of :mod:`gradsift.core.plain` in one ``uint8`` tensor: DCP stores tensors as tensors, and
the bytes are read back with ``torch.load(weights_only=True)``, so a checkpoint never runs
code. Loading reads the entry's size from the checkpoint's metadata, loads the bytes, and
restores them through the one checked path (:func:`gradsift.integrations.checkpoint.restore_hook_state`:
settings, shapes, finiteness, step and counts checked before anything is loaded). A
checkpoint of another world size is refused: residuals belong to a rank.

Example::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gradsift.integrations.dcp import hook_state_dict, load_hook_state_dict

    model_sd, optim_sd = get_state_dict(ddp_model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, **hook_state_dict(state)}, checkpoint_id=path)
    # resume: a new run registers the hook as before, then
    model_sd, optim_sd = get_state_dict(ddp_model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(ddp_model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    load_hook_state_dict(state, path)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gradsift.core.collectives import collective_device
from gradsift.core.errors import InvalidOptionError
from gradsift.core.plain import plain_bytes, read_plain
from gradsift.hook.handshake import hook_settings
from gradsift.integrations.checkpoint import check_same_world_size, restore_hook_state, to_cpu

#: The key of rank ``r``'s entry in the checkpoint.
KEY = "gradsift_hook/rank{rank}"


def hook_state_dict(state: Any, group: Any = None) -> dict[str, torch.Tensor]:
    """This rank's entry for ``dcp.save``: ``{KEY: bytes}`` (module docstring)."""
    rank = dist.get_rank(group)
    entry = {
        "world_size": dist.get_world_size(group),
        "settings": hook_settings(state),
        "state": to_cpu(state.state_dict()),
    }
    return {KEY.format(rank=rank): plain_bytes(entry, f"rank {rank}'s hook state")}


def load_hook_state_dict(
    state: Any,
    checkpoint_id: str | os.PathLike[str],
    group: Any = None,
    device: torch.device | str | None = None,
) -> None:
    """Collective: restore this rank's entry of the DCP checkpoint at ``checkpoint_id`` into
    ``state``, checked first; ``device`` as for :func:`~gradsift.integrations.checkpoint.load_hook_state`."""
    rank = dist.get_rank(group)
    key = KEY.format(rank=rank)
    reader = dcp.FileSystemReader(os.fspath(checkpoint_id))
    saved = reader.read_metadata().state_dict_metadata
    ranks = sorted(int(name.rsplit("rank", 1)[1]) for name in saved if name.startswith("gradsift_hook/rank"))
    if key not in saved:
        raise InvalidOptionError(
            f"{os.fspath(checkpoint_id)} holds no gradsift hook state for rank {rank} "
            f"(saved ranks: {ranks or 'none'}); save it with hook_state_dict(state) in dcp.save"
        )
    check_same_world_size(len(ranks), group)
    size = saved[key].size  # type: ignore[union-attr]
    buffer = torch.empty(size, dtype=torch.uint8)
    dcp.load({key: buffer}, storage_reader=reader, process_group=group)
    where = f"{os.fspath(checkpoint_id)}'s hook state of rank {rank}"
    entry = read_plain(buffer, where)
    if not isinstance(entry, dict) or {"world_size", "settings", "state"} - set(entry):
        raise InvalidOptionError(f"{where} is not a gradsift DCP entry (keys world_size, settings, state)")
    check_same_world_size(entry["world_size"], group)
    placed_on = collective_device(group) if device is None else device
    restore_hook_state(state, entry["state"], entry["settings"], placed_on, where)
