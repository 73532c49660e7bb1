"""Cost of SIDCo's compress on one large fp32 vector, beside torch.topk and one read pass.

Run under the shared benchmark lock (see README.md). Medians of round-robin repeats,
all methods measured side by side in one process on the same vector.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import gradsift
from gradsift.tools.benchmarking import interleaved_medians_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((args.numel,))
    k = max(1, int(args.numel * args.ratio))
    methods = {
        "read_pass_l1": lambda: torch.linalg.vector_norm(x, 1),
        "topk": lambda: torch.topk(x.abs(), k, sorted=False),
    }
    for name in ("sidco-exp", "sidco-gpareto", "sidco-gamma"):
        compressor = gradsift.get_compressor(name, ratio=args.ratio)
        methods[name] = lambda c=compressor: c.compress(x)
    stamp = provenance.start(seeds=[0])
    results = interleaved_medians_ms(methods, args.repeat)
    read = results["read_pass_l1"]
    report = {
        "command_args": vars(args),
        "provenance": stamp.finish(),
        "median_ms": results,
        "x_read_pass": {name: t / read for name, t in results.items()},
        "topk_speedup": {
            name: results["topk"] / results[name] for name in results if name.startswith("sidco")
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
