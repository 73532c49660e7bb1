"""Where SIDCo's statistical path becomes cheaper than exact top-k (see README.md for the command).

For each size, side by side in one process (round-robin medians, several calls per
timing at small sizes): the ``topk`` compressor, ``sidco-exp`` forced onto its
statistical path at every size (``exact_below=0``) and ``sidco-exp`` with its
default ``exact_below``. ``crossover`` is the smallest size from which the
statistical path is cheaper than ``topk`` at that and every larger size measured;
``docs/decisions.md`` sets ``sidco``'s ``EXACT_BELOW`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import gradsift
from gradsift.benchmarking import INPUT_DESCRIPTION, interleaved_medians_ms, synthetic_gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exponents", type=float, nargs="+", default=[e / 2 for e in range(20, 41)],
                        help="sizes 2^e (default: 2^10 .. 2^20 in half octaves)")  # fmt: skip
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for exponent in args.exponents:
        numel = round(2**exponent)
        x = synthetic_gradient(numel)
        compressors = {
            "topk": gradsift.get_compressor("topk", ratio=args.ratio),
            "sidco-exp statistical": gradsift.get_compressor("sidco-exp", ratio=args.ratio, exact_below=0),
            "sidco-exp": gradsift.get_compressor("sidco-exp", ratio=args.ratio),
        }
        methods = {name: (lambda c=c, x=x: c.compress(x)) for name, c in compressors.items()}
        medians = interleaved_medians_ms(methods, args.repeats, inner=max(1, (1 << 17) // numel), warmup=6)
        rows.append({"numel": numel, "median_ms": medians})
        print(
            f"n={numel:>9,}  " + "  ".join(f"{name} {ms:.4f} ms" for name, ms in medians.items()), flush=True
        )
    cheaper = [r["median_ms"]["sidco-exp statistical"] < r["median_ms"]["topk"] for r in rows]
    crossover = next((rows[i]["numel"] for i in range(len(rows)) if all(cheaper[i:])), None)
    print(f"statistical path cheaper than topk from n = {crossover} on")
    if args.json:
        report = {"args": {**vars(args), "json": str(args.json)}, "input": INPUT_DESCRIPTION,
                  "torch": torch.__version__, "cpu_count": os.cpu_count(),
                  "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
                  "crossover": crossover, "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
