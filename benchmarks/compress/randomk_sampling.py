"""How random-k draws k of n positions: a cut random permutation vs the first k distinct of a stream.

Both are exact uniform sampling without replacement. ``randperm(n)[:k]`` draws from a
``torch.Generator`` (seeded per call); random-k's own sampler,
:func:`gradsift.compressors.randomk.sample_without_replacement`, hashes ``(key, counter)``
(:mod:`gradsift.compressors.draws`), so every device draws the same positions. Times are
medians of interleaved rounds, side by side, one seed or key per round.

Usage: python benchmarks/compress/randomk_sampling.py [--numel N] [--repeats R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gradsift.compressors.randomk import sample_without_replacement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    methods = {
        "randperm[:k]": lambda k, g: torch.randperm(n, generator=g)[:k],
        "first k distinct of a uniform stream": lambda k, g: sample_without_replacement(
            n, k, g.initial_seed(), torch.device("cpu")
        ),
    }
    stamp = provenance.start(seeds=list(range(args.repeats + 1)))  # one generator seed (and key) per round
    rows = []
    for ratio in args.ratios:
        k = int(n * ratio)
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for step in range(args.repeats + 1):  # round 0 warms up
            for name, draw in methods.items():
                generator = torch.Generator().manual_seed(step)
                start = time.perf_counter()
                draw(k, generator)
                if step:
                    samples[name].append((time.perf_counter() - start) * 1e3)
        for name, times in samples.items():
            rows.append({"method": name, "numel": n, "ratio": ratio, "median_ms": statistics.median(times)})
            print(f"n={n:,} ratio={ratio:g} {name:40s} {rows[-1]['median_ms']:9.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows, "provenance": stamp.finish()}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
