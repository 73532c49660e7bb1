"""TernGrad's error on real gradients: gradsift's ``terngrad`` against the paper's recipe.

Trains the trainer's models (``vgg``, ``lstm`` on Fashion-MNIST, ``gpt`` on the stdlib
text; one process, SGD lr 0.05 momentum 0.9, batch 32 / 16) for ``--warmup`` steps,
then takes ``--snapshots`` minibatch gradients ``--every`` steps apart. For each
snapshot and each configuration it measures the mean squared error of the ternarized
gradient against the real one, ``E ||Q(g) - g||^2`` summed over the model, by
Monte Carlo (``--draws`` compressions through gradsift's compress/decompress):

* ``bucket, no clip``: the model as one flat tensor (the DDP hook's default bucket
  granularity), no clipping -- gradsift before clipping was added;
* ``layer, no clip``: one scale per parameter tensor, no clipping;
* ``bucket, clip 2.5`` and ``layer, clip 2.5``: gradsift's ``terngrad`` now (default
  ``clip=2.5``; ``layer`` = the hook's ``granularity="layer"``).

The reference is the paper's recipe written out independently here, in closed form:
per layer, clip to 2.5 standard deviations of the layer's gradient (``torch.std``,
about the mean), scale ``s = max|h|``, so ``E ||Q - g||^2 = sum |h|(s - |h|) + (h - g)^2``.
The variance part alone (``sum |h|(s - |h|)``, no bias) is reported too.

    python benchmarks/quantizers/terngrad_variance.py --out results/quantizers/terngrad_variance.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import gradsift
from gradsift.tools.train.data import batches, shard_indices
from gradsift.tools.train.datasets import load_for_model
from gradsift.tools.train.loop import cross_entropy
from gradsift.tools.train.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

CLIP = 2.5
BATCH = {"vgg": 32, "lstm": 32, "gpt": 16}
CONFIGURATIONS = {
    "bucket, no clip": ("bucket", None),
    "layer, no clip": ("layer", None),
    "bucket, clip 2.5": ("bucket", CLIP),
    "layer, clip 2.5": ("layer", CLIP),
}


def snapshots(model_name: str, args: argparse.Namespace) -> tuple[list[list[torch.Tensor]], list[str]]:
    """Per snapshot, the list of per-parameter gradients (float64), and the parameter names."""
    train, _, _ = load_for_model(model_name, None, synthetic=False, seed=0)
    model = build_model(model_name, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = shard_indices(len(train), 0, 1, epoch=0, seed=0)
    taken: list[list[torch.Tensor]] = []
    for step, (inputs, targets) in enumerate(batches(train, order, BATCH[model_name])):
        optimizer.zero_grad()
        cross_entropy(model(inputs), targets).backward()
        if step >= args.warmup and (step - args.warmup) % args.every == 0:
            taken.append([p.grad.detach().to(torch.float64).reshape(-1).clone() for p in model.parameters()])
            if len(taken) == args.snapshots:
                break
        optimizer.step()
    return taken, [name for name, _ in model.named_parameters()]


def measured_error(gradients: list[torch.Tensor], granularity: str, clip: float | None, draws: int) -> float:
    """Monte Carlo ``E ||Q(g) - g||^2`` of gradsift's terngrad over the whole model."""
    compressor = gradsift.get_compressor("terngrad", clip=clip, seed=1)
    tensors = [torch.cat(gradients)] if granularity == "bucket" else gradients
    total = 0.0
    for tensor in tensors:
        for _ in range(draws):
            decoded = compressor.decompress([compressor.compress(tensor)], tensor.numel())
            total += float((decoded - tensor).square().sum()) / draws
    return total


def reference_error(gradients: list[torch.Tensor]) -> tuple[float, float]:
    """The paper's per-layer recipe in closed form: ``(E ||Q - g||^2, variance part)``."""
    error = variance = 0.0
    for g in gradients:
        bound = CLIP * float(g.std()) if g.numel() > 1 else float("inf")
        h = g.clamp(-bound, bound)
        scale = h.abs().max()
        part = float((h.abs() * (scale - h.abs())).sum())
        variance += part
        error += part + float((h - g).square().sum())
    return error, variance


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["vgg", "lstm", "gpt"])
    parser.add_argument("--warmup", type=int, default=100, help="training steps before the first snapshot")
    parser.add_argument("--snapshots", type=int, default=4)
    parser.add_argument("--every", type=int, default=25, help="steps between snapshots")
    parser.add_argument("--draws", type=int, default=16, help="compressions per tensor and snapshot")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    stamp = provenance.start(seeds=[0])
    results = {"command": vars(args) | {"out": str(args.out)}, "clip": CLIP, "models": {}}
    for name in args.models:
        taken, names = snapshots(name, args)
        rows = []
        for index, gradients in enumerate(taken):
            reference, reference_variance = reference_error(gradients)
            row = {"snapshot": index, "step": args.warmup + index * args.every, "reference_mse": reference,
                   "reference_variance": reference_variance, "gradient_sq_norm": float(sum(g.square().sum() for g in gradients))}  # fmt: skip
            for label, (granularity, clip) in CONFIGURATIONS.items():
                row[label] = measured_error(gradients, granularity, clip, args.draws)
            rows.append(row)
            print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        ratios = {label: [r[label] / r["reference_mse"] for r in rows] for label in CONFIGURATIONS}
        results["models"][name] = {
            "parameters": len(names),
            "snapshots": rows,
            "ratio_to_reference": {label: {"min": min(v), "max": max(v), "mean": sum(v) / len(v)}
                                   for label, v in ratios.items()},
        }  # fmt: skip
    results["provenance"] = stamp.finish()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for name, model in results["models"].items():
        for label, spread in model["ratio_to_reference"].items():
            print(
                f"{name:5s} {label:18s} MSE / reference: {spread['min']:.2f}-{spread['max']:.2f} (mean {spread['mean']:.2f})"
            )


if __name__ == "__main__":
    main()
