"""Plain PyTorch DDP with gradsift: one added line, ``gradsift.register_comm_hook(...)``.

``--compressor`` defaults to ``auto`` (it measures the link -- on sidco-exp under SGD --, then the
fastest method that keeps quality for the optimizer; on localhost usually stock DDP);
name a method to compress, e.g. ``--compressor topk --ratio 0.01`` (docs/integrations.md).
A small classifier on synthetic data (a fixed random "teacher" labels Gaussian inputs),
so the script runs anywhere in seconds. Rank 0 writes checkpoints that hold the model,
the optimizer *and every rank's hook state* (error-feedback residuals, compressor state),
so a resumed run continues exactly where it stopped.

One machine, two processes (CPU/gloo or one GPU each/NCCL), a checkpoint at step 20::

    torchrun --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 40 --checkpoint-every 20

Resume from it; ``resumed/last.pt`` then equals ``checkpoints/last.pt``::

    torchrun --standalone --nproc-per-node 2 examples/ddp_torchrun.py --steps 40 \
        --resume checkpoints/step20.pt --checkpoint-dir resumed

Several machines: the torchrun line in ``examples/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state, parameters_agree

FEATURES, CLASSES = 32, 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="train until this global step")
    parser.add_argument(
        "--compressor",
        default="auto",
        help="gradsift registry name, or auto (default): it measures the link (on sidco-exp under SGD), then the "
        "fastest method that keeps quality for the optimizer",
    )
    parser.add_argument(
        "--ratio", type=float, help="target density of a named sparsifier (default: the compressor's own)"
    )
    parser.add_argument(
        "--granularity",
        choices=("bucket", "layer"),
        default="bucket",
        help="compress per DDP bucket or per layer",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also save every N steps (0: at the end only)"
    )
    parser.add_argument("--resume", type=Path, help="checkpoint to continue from")
    parser.add_argument("--tensorboard", type=Path, help="write hook statistics here (gradsift[tensorboard])")
    return parser.parse_args()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # every rank starts from the same weights (DDP also broadcasts them)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))


def batch(step: int, rank: int, world: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a pure function of (seed, step, rank), so resuming replays it."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(args.seed))
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * world + rank + 1)
    inputs = torch.randn(args.batch_size, FEATURES, generator=generator)
    return inputs, (inputs @ teacher).argmax(dim=1)


def save(path: Path, step: int, ddp_model, optimizer, hook_state) -> None:
    """Collective: gather every rank's hook state; rank 0 writes one file."""
    hooks = gather_hook_states(hook_state)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = {
            "step": step,
            "model": ddp_model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        torch.save({**checkpoint, "gradsift": hooks, "stats": hook_state.stats()}, path)


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        # before the process group: NCCL and every "cuda" tensor without an index
        # (gather_object's buffers too) then use this rank's GPU, not cuda:0
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.seed).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    # The one gradsift line: compress every DDP bucket before it is exchanged; with
    # optimizer= the hook takes SGD's momentum over (DGC's momentum correction). auto
    # picks its method's options itself and refuses --ratio.
    ratio = {} if args.ratio is None else {"ratio": args.ratio}
    hook_state = gradsift.register_comm_hook(
        ddp_model, args.compressor, **ratio, granularity=args.granularity, optimizer=optimizer
    )

    step = 0
    if args.resume is not None:
        # on the CPU: rank 0's file holds every rank's hook state; each rank keeps its own
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        ddp_model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # moves its state to the parameters' device
        load_hook_state(hook_state, checkpoint["gradsift"], device=device)
        step = checkpoint["step"]

    writer = None
    if args.tensorboard is not None and rank == 0:
        from gradsift.integrations.tensorboard import open_writer

        writer = open_writer(args.tensorboard)
    while step < args.steps:
        inputs, labels = batch(step, rank, world, args)
        loss = torch.nn.functional.cross_entropy(ddp_model(inputs.to(device)), labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if writer is not None:
            from gradsift.integrations.tensorboard import write_stats

            write_stats(writer, hook_state.stats(), step)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(args.checkpoint_dir / f"step{step}.pt", step, ddp_model, optimizer, hook_state)

    save(args.checkpoint_dir / "last.pt", step, ddp_model, optimizer, hook_state)
    agree = parameters_agree(ddp_model.module)
    if rank == 0:
        total = hook_state.stats()["total"]
        summary = {"step": step, "loss": float(loss.detach()), "compressor": hook_state.compressor.name,
                   "bytes_sent": total["bytes_sent"], "dense_bytes": total["dense_bytes"], "density": total["density"],
                   "replicas_agree": agree}  # fmt: skip
        print("gradsift-example", json.dumps(summary), flush=True)
    if writer is not None:
        writer.close()
    dist.barrier()  # leave together, so no rank tears the group down under a peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
