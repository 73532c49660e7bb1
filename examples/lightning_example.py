"""PyTorch Lightning with gradsift: a callback, and the hook offered to ``DDPStrategy``.

``GradsiftCallback`` provides the hook state and callable for
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` (used by Lightning on CUDA), registers
the hook itself where Lightning does not (CPU/gloo, and always under ``auto``), logs the
hook's statistics to the trainer's loggers and saves every rank's hook state in Lightning's
checkpoints. ``--compressor`` defaults to ``auto``; name a method to compress, e.g.
``--compressor topk --ratio 0.01`` (docs/integrations.md).

Two CPU processes (Lightning launches them itself), 8 steps an epoch::

    python examples/lightning_example.py --epochs 3

Resume from a checkpoint (model, optimizer, loops and the gradsift hook state; after step
10, where ``auto`` decided, so the choice resumes with it)::

    python examples/lightning_example.py --epochs 3 --resume "checkpoints/epoch=1.ckpt" --checkpoint-dir resumed
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from gradsift.integrations.checkpoint import parameters_agree
from gradsift.integrations.lightning import GradsiftCallback

FEATURES, CLASSES, SAMPLES = 32, 10, 512


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(seed: int) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--compressor",
        default="auto",
        help="gradsift registry name, or auto (default): it measures the link (on sidco-exp under SGD), then the "
        "fastest method that keeps quality for the optimizer",
    )
    parser.add_argument(
        "--ratio", type=float, help="target density of a named sparsifier (default: the compressor's own)"
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", type=Path, help="a Lightning checkpoint to continue from")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    ratio = {} if args.ratio is None else {"ratio": args.ratio}  # auto picks its own and refuses one
    gradsift_callback = GradsiftCallback(args.compressor, **ratio)
    trainer = pl.Trainer(
        accelerator="auto",  # one GPU per process with CUDA (NCCL), else CPU processes (gloo)
        devices=args.devices,
        strategy=DDPStrategy(**gradsift_callback.strategy_kwargs()),
        max_epochs=args.epochs,
        callbacks=[gradsift_callback, ModelCheckpoint(args.checkpoint_dir, "{epoch}", save_top_k=-1)],
        logger=CSVLogger("logs"),
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier()
    loader = DataLoader(dataset(0), batch_size=32, shuffle=False)
    trainer.fit(model, loader, ckpt_path=args.resume)

    agree = parameters_agree(model)  # the process group is still up after fit
    if trainer.is_global_zero:
        total = gradsift_callback.state.stats()["total"]
        summary = {"step": trainer.global_step, "compressor": gradsift_callback.state.compressor.name,
                   "bytes_sent": total["bytes_sent"], "dense_bytes": total["dense_bytes"], "density": total["density"],
                   "replicas_agree": agree}  # fmt: skip
        print("gradsift-example", json.dumps(summary), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
