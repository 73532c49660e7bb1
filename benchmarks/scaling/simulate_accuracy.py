"""Accuracy against the number of workers, on one machine: exchanges through gradsift.tools.simulate.

Each point is the run ``gradsift train`` would make -- the same model (``mlp-wide``, drawn
from the seed), the same per-rank shards of Fashion-MNIST (``shard_indices`` per epoch,
mini-batches in shard order), the same SGD (lr 0.05, momentum 0.9) and the same hook
options (the recipe's density warm-up, DGC's momentum correction) -- but with its W ranks
simulated as threads of this process (:func:`gradsift.tools.simulate.simulate`, bit-identical to
W gloo processes), so 64 or 256 workers fit on a few cores. Per exchange, worker count and
seed it records the test accuracy and loss every ``--eval-every`` steps and after the
last, rank 0's training loss per step, the hook's bytes sent and received per worker and step (means), and the wall time.

    python benchmarks/scaling/simulate_accuracy.py --workers 2 4 8 16 32 64 --steps 300
    python benchmarks/scaling/simulate_accuracy.py --workers 2 --steps 3 --eval-every 0 --out /tmp/smoke.json

Results go to ``--out`` (default ``results/scaling/simulated/results.json``), one row per run, written
after every run; a row already there (same exchange, workers, seed and settings) is
skipped, so an interrupted sweep resumes. Each row carries its own provenance stamp
(benchmarks/provenance.py); run it under the CPU lock (``flock /tmp/gradsift-cpu.lock``)
when its wall times matter. Memory grows with W: every rank holds its model, gradients,
DDP buckets, optimizer and residual state (mlp-wide, allgather: about 75 MB per rank, peak
RSS 727 MB at 2 workers and 1022 MB at 6; so 64 workers need about 5 GB, 256 about 19 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradsift.tools.simulate import simulate
from gradsift.tools.train.config import TrainConfig, build_optimizer
from gradsift.tools.train.data import batches, shard_indices
from gradsift.tools.train.datasets import load_for_model
from gradsift.tools.train.exchange import recipe_options
from gradsift.tools.train.loop import cross_entropy
from gradsift.tools.train.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

RESULTS = results_dir(__file__)
EXCHANGES = ("allgather", "balanced", "shared-mask")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--exchanges", nargs="+", default=list(EXCHANGES), choices=EXCHANGES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per worker per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compressor", default="sidco-exp")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--model", default="mlp-wide")
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulated" / "results.json")
    return parser.parse_args(argv)


class Shards:
    """``gradsift train``'s batches: rank ``r``'s step ``s`` is batch ``s mod B`` of its shard of
    epoch ``s div B`` (``B`` batches per epoch, the last one maybe short)."""

    def __init__(self, train: Any, world: int, batch_size: int, seed: int) -> None:
        self.train, self.world, self.batch_size, self.seed = train, world, batch_size, seed
        per_rank = -(-len(train) // world)
        self.per_epoch = -(-per_rank // batch_size)
        self._epochs: dict[int, list[torch.Tensor]] = {}

    def __call__(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, position = divmod(step, self.per_epoch)
        if epoch not in self._epochs:  # ranks may race here: both compute the same shards
            self._epochs[epoch] = [
                shard_indices(len(self.train), r, self.world, epoch=epoch, seed=self.seed)
                for r in range(self.world)
            ]
        start = position * self.batch_size
        return self.train[self._epochs[epoch][rank][start : start + self.batch_size]]


def test_metrics(test: Any) -> Any:
    """``model -> {"accuracy", "loss"}`` over the whole test split (what the trainer's
    ``evaluate`` computes, here on one rank: every rank holds the same model)."""

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        correct, loss_sum, count = 0, 0.0, 0
        model.eval()
        for inputs, targets in batches(test, torch.arange(len(test)), 500):
            logits = model(inputs)
            correct += int((logits.argmax(dim=-1) == targets).sum())
            loss_sum += float(cross_entropy(logits, targets, reduction="sum"))
            count += targets.numel()
        model.train()
        return {"accuracy": correct / count, "loss": loss_sum / count}

    return evaluate


def run_one(args: argparse.Namespace, exchange: str, workers: int, seed: int, data: tuple) -> dict[str, Any]:
    """One simulated run, as a result row."""
    options = {"ratio": args.ratio, "exchange": exchange}
    config = TrainConfig(
        out="", model=args.model, compressor=args.compressor, options=options, workers=workers,
        batch_size=args.batch_size, lr=args.lr, steps=args.steps, eval_every=args.eval_every, seed=seed,
        data_dir=args.data_dir,
    )  # fmt: skip
    train, test, _ = data
    stamp = provenance.start(seeds=[seed])
    began = time.perf_counter()
    sim = simulate(
        lambda: build_model(config.model, seed),
        Shards(train, workers, config.batch_size, seed),
        workers=workers,
        steps=config.steps,
        compressor=config.compressor,
        optimizer_fn=lambda parameters: build_optimizer(config, parameters),
        loss_fn=cross_entropy,
        evaluate=test_metrics(test),
        eval_every=config.eval_every,
        seed=seed,
        **recipe_options(config.compressor, options, config.steps),
    )
    wall = time.perf_counter() - began
    cells = workers * config.steps
    return {
        **key_of(args, exchange, workers, seed),
        "evals": [{"step": step, **metrics} for step, metrics in sorted(sim.evaluations.items())],
        "final_accuracy": sim.evaluations[config.steps]["accuracy"],
        "rank0_train_loss": [losses[0] for losses in sim.losses],  # what gradsift train logs
        "bytes_sent_per_step": sum(map(sum, sim.bytes_sent)) / cells,
        "bytes_received_per_step": sum(map(sum, sim.bytes_received)) / cells,
        "ranks_agree": sim.ranks_agree,
        "wall_s": round(wall, 2),
        "provenance": stamp.finish(),
    }


def key_of(args: argparse.Namespace, exchange: str, workers: int, seed: int) -> dict[str, Any]:
    """What makes two rows the same run."""
    return {
        "exchange": exchange, "workers": workers, "seed": seed, "steps": args.steps, "eval_every": args.eval_every,
        "batch_size": args.batch_size, "lr": args.lr, "compressor": args.compressor, "ratio": args.ratio,
        "model": args.model,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows: list[dict[str, Any]] = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    data = load_for_model(args.model, args.data_dir, synthetic=False, seed=0)
    for workers in args.workers:
        for seed in args.seeds:
            for exchange in args.exchanges:
                key = key_of(args, exchange, workers, seed)
                if any(all(row.get(k) == v for k, v in key.items()) for row in rows):
                    continue
                row = run_one(args, exchange, workers, seed, data)
                rows.append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"runs": rows}, indent=1) + "\n")
                print(
                    f"{exchange:12s} W={workers:3d} seed={seed} accuracy {row['final_accuracy']:.4f} "
                    f"received {row['bytes_received_per_step']:.0f} B/step  {row['wall_s']:.1f} s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
