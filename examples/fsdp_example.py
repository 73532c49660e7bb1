"""FSDP with gradsift: the same one line, ``gradsift.register_comm_hook(model, ...)``.

A small regression MLP (a fixed random "teacher", Gaussian inputs), one FSDP unit per
Linear layer, trained on every rank's own batches. ``--sharding`` picks what gradsift
takes over (``docs/integrations.md`` explains why these and no others):

* ``no_shard`` -- FSDP1 ``NO_SHARD``: each unit's gradient is compressed (default
  ``sidco-exp`` at 5 %, error feedback) instead of all-reduced;
* ``hybrid`` -- FSDP2 hybrid sharding: ``fully_shard`` within a node, gradsift on the
  all-reduce across nodes (``--ranks-per-node`` ranks form a node; 1 makes each local
  process a "node", so two processes show the inter-node exchange);
* ``full_shard`` -- FSDP1 ``FULL_SHARD``: the reduce-scatter in ``fp16``/``bf16``.

The method is a named one (``--compressor``; the defaults above): ``compressor="auto"``,
the default of the DDP examples, switches methods on DDP's buckets, and gradsift refuses it
on FSDP models.

``--stock`` trains the same setup with FSDP's own exchange (no gradsift), for comparison.
``--checkpoint-every N`` saves the model and every rank's hook state every N steps into
``--checkpoint-dir`` (plain SGD keeps no state); ``--resume PATH`` continues from such a
file. Two CPU processes with a checkpoint at step 30, then FSDP's own, then the run resumed
from step 30 (it prints the first run's summary)::

    torchrun --standalone --nproc-per-node 2 examples/fsdp_example.py --sharding hybrid --steps 60 --checkpoint-every 30
    torchrun --standalone --nproc-per-node 2 examples/fsdp_example.py --sharding hybrid --steps 60 --stock
    torchrun --standalone --nproc-per-node 2 examples/fsdp_example.py --sharding hybrid --steps 60 --resume checkpoints/step30.pt

Rank 0 ends with one line ``gradsift-example {"loss": ..., "bytes_sent": ..., "dense_bytes": ...,
"replicas_agree": true, ...}`` (``loss`` on a held-out set).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

import gradsift
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state

FEATURES, OUTPUTS = 16, 4
#: The method without ``--compressor``, per ``--sharding``: the sharded reduce-scatter takes casts
#: only. Not ``auto``: it switches methods on DDP's buckets, and gradsift refuses it on FSDP.
DEFAULT_METHOD = {"no_shard": ("sidco-exp", {"ratio": 0.05}), "hybrid": ("sidco-exp", {"ratio": 0.05}),
                  "full_shard": ("fp16", {})}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sharding", choices=("no_shard", "hybrid", "full_shard"), default="hybrid")
    parser.add_argument(
        "--compressor",
        help="gradsift registry name (default: sidco-exp at ratio 0.05; fp16 for full_shard, whose "
        "reduce-scatter takes casts only). Not auto, the DDP examples' default: it switches methods "
        "on DDP's buckets, and gradsift refuses it on FSDP models",
    )
    parser.add_argument(
        "--ratio",
        type=float,
        help="target density of a sparsifier (default: 0.05 for the default sidco-exp, else the named "
        "compressor's own; a cast refuses it)",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=1, help="hybrid: ranks that shard one model copy"
    )
    parser.add_argument("--stock", action="store_true", help="FSDP's own exchange, no gradsift")
    parser.add_argument("--steps", type=int, default=60, help="train until this global step")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    parser.add_argument("--resume", type=Path, help="checkpoint to continue from")
    return parser.parse_args()


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every rank starts from the same weights
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, OUTPUTS)
    )


def teacher(seed: int) -> torch.Tensor:
    return torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(seed))


def batch(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a pure function of (seed, step, rank), so resuming replays it."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank + 1)
    inputs = torch.randn(32, FEATURES, generator=generator)
    return inputs, torch.tanh(inputs @ teacher(args.seed))


def wrap(args: argparse.Namespace) -> tuple[nn.Module, dict]:
    """The FSDP model and the options gradsift's hook needs for it."""
    model = make_model(args.seed)
    if args.sharding == "hybrid":
        world = dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (world // args.ranks_per_node, args.ranks_per_node), mesh_dim_names=("replicate", "shard")
        )
        # gradsift: shard within a node, gradsift all-reduces across nodes. Stock: FSDP2's own HSDP.
        shard_mesh = mesh if args.stock else mesh["shard"]
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        return model, {"process_group": mesh.get_group("replicate")}
    strategy = ShardingStrategy.NO_SHARD if args.sharding == "no_shard" else ShardingStrategy.FULL_SHARD

    def per_layer(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, nn.Linear)

    fsdp = FullyShardedDataParallel(
        model, sharding_strategy=strategy, auto_wrap_policy=per_layer, device_id=torch.device("cpu")
    )
    return fsdp, {}


def replicas_agree(model_state: dict[str, torch.Tensor]) -> bool:
    """Collective: every rank holds the same full parameters."""
    flat = torch.cat([tensor.reshape(-1) for tensor in model_state.values()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(c, flat) for c in copies)


def save(
    path: Path,
    step: int,
    model: nn.Module,
    hook_state: gradsift.GradsiftHookState | None,
    full: StateDictOptions,
) -> None:
    """Collective: rank 0 writes the full model and every rank's hook state to ``path``."""
    model_state = get_model_state_dict(model, options=full)
    hooks = None if hook_state is None else gather_hook_states(hook_state)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "model": model_state, "gradsift": hooks}, path)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, hook_options = wrap(args)
    hook_state = None
    if not args.stock:
        compressor, options = (
            DEFAULT_METHOD[args.sharding] if args.compressor is None else (args.compressor, {})
        )
        if args.ratio is not None:  # a cast refuses it
            options = {**options, "ratio": args.ratio}
        # The one gradsift line.
        hook_state = gradsift.register_comm_hook(model, compressor, **options, **hook_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # plain SGD: it keeps no state
    full = StateDictOptions(full_state_dict=True)  # full tensors on every rank

    step = 0
    if args.resume is not None:
        saved = torch.load(args.resume, map_location="cpu", weights_only=True)
        set_model_state_dict(model, saved["model"], options=full)
        if hook_state is not None:
            load_hook_state(hook_state, saved["gradsift"])
        step = saved["step"]
    while step < args.steps:
        inputs, targets = batch(step, rank, args)
        loss = ((model(inputs) - targets) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(args.checkpoint_dir / f"step{step}.pt", step, model, hook_state, full)

    model_state = get_model_state_dict(model, options=full)
    held_out = torch.randn(512, FEATURES, generator=torch.Generator().manual_seed(args.seed + 999_983))
    with torch.no_grad():
        eval_loss = float(((model(held_out) - torch.tanh(held_out @ teacher(args.seed))) ** 2).mean())
    agree = replicas_agree(model_state)
    if rank == 0:
        total = {} if hook_state is None else hook_state.stats()["total"]
        summary = {"sharding": args.sharding, "stock": args.stock, "step": step, "loss": eval_loss,
                   "bytes_sent": total.get("bytes_sent"), "dense_bytes": total.get("dense_bytes"),
                   "replicas_agree": agree}  # fmt: skip
        print("gradsift-example", json.dumps(summary), flush=True)
    dist.barrier()  # leave together, so no rank tears the group down under a peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
