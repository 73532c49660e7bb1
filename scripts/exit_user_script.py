"""A plain user script: DDP on gloo with gradsift's one line, then exit without a barrier.

What a user writes, nothing more: join the group from the environment (torchrun or
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set by hand), wrap a small MLP in
DDP, register the hook, train, ``dist.destroy_process_group()``, return. No barrier, no
``os._exit``: the process ends through normal interpreter finalization, which is where
an exit that is not clean shows (``scripts/exit_stress.py`` runs this many times).

    torchrun --standalone --nproc-per-node 2 scripts/exit_user_script.py --compressor sidco-exp

``--compressor stock`` runs stock DDP (no hook); ``--compressor torch-allreduce-hook``
registers PyTorch's own Python allreduce hook (``default_hooks.allreduce_hook``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gradsift

#: Controls beside the gradsift compressors: no hook at all, and PyTorch's Python hook.
STOCK, TORCH_HOOK = "stock", "torch-allreduce-hook"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compressor", default="sidco-exp", help=f"registry name, {STOCK} or {TORCH_HOOK}")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _trained = train(args.compressor, args.steps)  # held until main returns, like any script's objects
    dist.destroy_process_group()


def train(compressor: str, steps: int) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    """The script's training, in a process group already joined: a small MLP in DDP with
    ``compressor``'s hook (or :data:`STOCK`, :data:`TORCH_HOOK`), ``steps`` SGD steps.
    Returns the model and the optimizer, which the caller holds past
    ``destroy_process_group()`` as a script's locals live until it returns."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp_model = DistributedDataParallel(model)
    if compressor == TORCH_HOOK:
        ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif compressor != STOCK:
        gradsift.register_comm_hook(ddp_model, compressor)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(32, 32, generator=generator)
        labels = torch.randint(0, 10, (32,), generator=generator)
        loss = torch.nn.functional.cross_entropy(ddp_model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return ddp_model, optimizer


if __name__ == "__main__":
    main()
