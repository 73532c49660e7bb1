"""Hugging Face Accelerate with gradsift: ``Accelerator()`` + ``prepare(...)``, then the hook.

``accelerator.prepare`` wraps the model in ``DistributedDataParallel`` when several
processes run; gradsift's hook is registered on that prepared model. The main process
saves one checkpoint holding the model, the optimizer and every rank's hook state.
``--compressor`` defaults to ``auto``; name a method to compress, e.g. ``--compressor topk
--ratio 0.01`` (docs/integrations.md).

Two CPU processes, with Accelerate's multi-process launcher (which is torchrun: it needs
no GPU; ``--cpu`` instead selects a one-process launcher that expects ``mpirun`` to start
the others)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/accelerate_example.py --steps 40 \
        --checkpoint-every 20

Resume, with the same launcher::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/accelerate_example.py --steps 40 \
        --resume checkpoints/step20.pt --checkpoint-dir resumed
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import gradsift
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state, parameters_agree

FEATURES, CLASSES, SAMPLES = 32, 10, 4096


def dataset(seed: int) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--compressor",
        default="auto",
        help="gradsift registry name, or auto (default): it measures the link (on sidco-exp under SGD), then the "
        "fastest method that keeps quality for the optimizer",
    )
    parser.add_argument(
        "--ratio", type=float, help="target density of a named sparsifier (default: the compressor's own)"
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also save every N steps (0: at the end only)"
    )
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()

    # cpu=True on a machine without CUDA: Accelerate then runs multi-process CPU training on gloo
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.num_processes < 2:
        raise SystemExit(
            "accelerate_example.py needs 2 or more processes, and this is the only one: launch it with "
            "`accelerate launch --multi_gpu --num_processes 2 ...` or `torchrun --standalone --nproc-per-node 2 ...` "
            "(`accelerate launch --cpu` starts one process and expects mpirun to start the others)"
        )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(dataset(0), batch_size=32, shuffle=False)  # prepare() shards it across ranks
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ratio = {} if args.ratio is None else {"ratio": args.ratio}  # auto picks its own and refuses one
    hook_state = gradsift.register_comm_hook(model, args.compressor, **ratio, optimizer=optimizer)

    def save(path: Path, step: int) -> None:
        hooks = gather_hook_states(hook_state)  # collective: every rank takes part
        if accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
            }
            accelerator.save({"step": step, **state, "gradsift": hooks}, path)

    step = 0
    if args.resume is not None:
        # on the CPU: the file holds every rank's hook state; each rank keeps its own
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        accelerator.unwrap_model(model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # moves its state to the parameters' device
        load_hook_state(hook_state, checkpoint["gradsift"], device=accelerator.device)
        step = checkpoint["step"]

    batches_per_epoch = len(loader)
    while step < args.steps:
        # skip the batches of this epoch that the checkpointed run already trained on
        for inputs, labels in accelerator.skip_first_batches(loader, step % batches_per_epoch):
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save(args.checkpoint_dir / f"step{step}.pt", step)
            if step == args.steps:
                break

    save(args.checkpoint_dir / "last.pt", step)
    agree = parameters_agree(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        total = hook_state.stats()["total"]
        summary = {"step": step, "compressor": hook_state.compressor.name, "bytes_sent": total["bytes_sent"],
                   "dense_bytes": total["dense_bytes"], "density": total["density"], "replicas_agree": agree}  # fmt: skip
        print("gradsift-example", json.dumps(summary), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
