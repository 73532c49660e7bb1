"""A per-worker state loads only on the rank that saved it (``gradsift.core.worker_state``).

The usual DDP checkpoint is written by rank 0 and read by every rank: the model's and a stock
optimizer's states are the same on every rank. The hook's residuals and DeMo's and
Distributed Lion's momenta are not (the oracle: the two ranks' saved tensors differ). On two
real gloo ranks, rank 0 writes ``state_dict()`` of the hook (``topk``), of DeMo and of
Distributed Lion to one file, as such a script does, and each rank loads it into a fresh
object: rank 0 takes it, rank 1 refuses it naming both ranks and how to save every rank's
state. Before, rank 1 took rank 0's residuals and momenta without an error. Each rank's own
state still loads; so does a state saved before the stamp; one of another world size does not.

The same under FSDP2's hybrid sharding with the two ranks as one shard group (a mesh of one
replica of two shards): the hook's group is the replicate dimension, where both ranks are rank
0 of 1, and each holds its own shard's residuals of the same shapes -- the process's rank in
the stamp tells them apart (before, rank 1 took rank 0's shard residuals).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KINDS = ("hook", "demo", "lion", "hsdp")


def built(kind: str) -> tuple[Any, Any, Any]:
    """The model, its optimizer and the per-worker state holder (the hook state, or the optimizer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
        for layer in (*model[::2], model):
            fully_shard(layer, mesh=mesh["shard"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        group = mesh.get_group("replicate")
        return model, optimizer, gradsift.register_comm_hook(model, "topk", ratio=0.1, process_group=group)
    if kind == "hook":
        ddp = DDP(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state = gradsift.register_comm_hook(ddp, "topk", ratio=0.1, warmup_steps=1, optimizer=optimizer)
        return ddp, optimizer, state
    exchanging = gradsift.DeMo if kind == "demo" else gradsift.DistributedLion
    optimizer = exchanging(model.parameters(), lr=1e-3)
    return model, optimizer, optimizer


def per_worker_tensors(saved: dict[str, Any], kind: str) -> torch.Tensor:
    """The saved tensors that are this worker's own, in one vector: the hook's store, the optimizers' state."""
    tables = saved["store"] if kind in ("hook", "hsdp") else saved["state"]
    found: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found.append(value.reshape(-1))
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)

    collect(tables)
    return torch.cat(found)


def worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in KINDS:
        model, optimizer, holder = built(kind)
        for step in range(3):
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
        own = holder.state_dict()
        path = Path(folder, f"{kind}.pt")
        if rank == 0:
            torch.save(own, path)  # the usual DDP checkpoint: rank 0's, read by every rank
        dist.barrier()
        _, _, fresh = built(kind)
        try:
            fresh.load_state_dict(torch.load(path, weights_only=False))
            results[kind, "rank 0's"] = "loaded"
        except InvalidOptionError as refusal:
            results[kind, "rank 0's"] = str(refusal)
        _, _, fresh = built(kind)
        fresh.load_state_dict(own)  # its own: loads
        results[kind, "own"] = per_worker_tensors(own, kind)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(__file__, "worker", 2, timeout=180, folder=str(tmp_path_factory.mktemp("saved")))


@pytest.mark.parametrize("kind", KINDS)
def test_rank_0s_state_loads_on_rank_0_and_is_refused_on_rank_1(
    runs: list[dict[str, Any]], kind: str
) -> None:
    first, second = runs
    assert not torch.equal(first[kind, "own"], second[kind, "own"])  # the premise: each worker's own
    assert first[kind, "rank 0's"] == "loaded"
    refusal = second[kind, "rank 0's"]
    group = "1" if kind == "hsdp" else "2"  # the hook's group: the replicate dimension under hybrid sharding
    rank = "0" if kind == "hsdp" else "1"
    assert (
        f"saved by rank 0 of {group} (process 0 of 2), and rank {rank} of {group} (process 1 of 2) loads it"
        in refusal
    )
    assert ("a file of its own" if kind in ("demo", "lion") else "gather_hook_states") in refusal


def test_under_hybrid_sharding_the_two_ranks_hold_residuals_of_the_same_shapes(
    runs: list[dict[str, Any]],
) -> None:
    """The premise of the hybrid case: nothing but the stamp could refuse rank 0's state on rank 1."""
    first, second = runs
    assert first["hsdp", "own"].shape == second["hsdp", "own"].shape


@pytest.mark.parametrize("kind", ("hook", "demo", "lion"))
def test_a_state_without_the_stamp_loads_and_one_of_another_world_does_not(
    one_process_group: None, kind: str
) -> None:
    holder = built(kind)[2]
    saved = holder.state_dict()
    stamped = saved if kind == "hook" else saved[holder.key]
    assert stamped["worker"] == {"rank": 0, "world_size": 1, "global_rank": 0, "global_world_size": 1}
    del stamped["worker"]  # a checkpoint older than the stamp
    built(kind)[2].load_state_dict(saved)
    stamped["worker"] = {"rank": 0, "world_size": 1}  # stamped with the group's numbers only
    built(kind)[2].load_state_dict(saved)
    stamped["worker"] = {"rank": 0, "world_size": 2}
    with pytest.raises(InvalidOptionError, match="saved by rank 0 of 2, and rank 0 of 1 loads it"):
        built(kind)[2].load_state_dict(saved)
    stamped["worker"] = {"rank": -1}
    with pytest.raises(InvalidOptionError, match="the saved worker must be"):
        built(kind)[2].load_state_dict(saved)
