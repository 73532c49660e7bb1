"""Backward time with VGC's variance hooks vs a plain backward, on the trainer's reference models.

Usage (from the repository root; the README gives the exact command used):
    flock /tmp/gradsift-cpu.lock python benchmarks/vgc/hook_overhead.py --out results/vgc/hook_overhead.json

For every model the plain model and the hooked copies (conv rule "approx" and "exact")
are timed round-robin, ``--repeats`` times each, so load changes hit all variants
alike; each sample times the forward and ``loss.backward()`` separately, and the
report gives medians of the backward alone and of forward + backward, with their
ratios to the plain model.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from gradsift.compressors.variance import VarianceTracker
from gradsift.tools.train.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir


def models(batch: int) -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """The trainer's reference models (gradsift.tools.train.models) on Fashion-MNIST-shaped input."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return {name: (build_model(name), images, labels) for name in ("mlp", "vgg", "lstm")}


def step_seconds(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, tracker: VarianceTracker | None
) -> tuple[float, float]:
    """``(forward seconds, backward seconds)`` of one training step's loss."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    forward_done = time.perf_counter()
    loss.backward()
    elapsed = time.perf_counter() - forward_done
    if tracker is not None:
        tracker.clear()
    return forward_done - start, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "hook_overhead.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    stamp = provenance.start(seeds=[0])

    results = {}
    for name, (model, x, y) in models(args.batch).items():
        variants = {"plain": (model, None)}
        for rule in ("approx", "exact"):
            hooked = copy.deepcopy(model)
            variants[f"hooks-{rule}-conv"] = (hooked, VarianceTracker(hooked, conv_rule=rule))
        for hooked, tracker in variants.values():  # warm-up
            step_seconds(hooked, x, y, tracker)
        backward, step = {v: [] for v in variants}, {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant, (hooked, tracker) in variants.items():
                forward_s, backward_s = step_seconds(hooked, x, y, tracker)
                backward[variant].append(backward_s)
                step[variant].append(forward_s + backward_s)
        median_backward = {v: statistics.median(s) for v, s in backward.items()}
        median_step = {v: statistics.median(s) for v, s in step.items()}
        results[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "median_backward_ms": {v: round(m * 1e3, 3) for v, m in median_backward.items()},
            "backward_ratio_to_plain": {
                v: round(m / median_backward["plain"], 3) for v, m in median_backward.items() if v != "plain"
            },
            "median_forward_backward_ms": {v: round(m * 1e3, 3) for v, m in median_step.items()},
            "forward_backward_ratio_to_plain": {
                v: round(m / median_step["plain"], 3) for v, m in median_step.items() if v != "plain"
            },
        }
        print(name, json.dumps(results[name]), flush=True)

    report = {
        "threads": args.threads,
        "batch": args.batch,
        "repeats": args.repeats,
        "results": results,
        "provenance": stamp.finish(),
    }
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
        handle.write("\n")


if __name__ == "__main__":
    main()
