"""Where each SIDCo variant's statistical path becomes cheaper than exact top-k (see README.md).

For each size, side by side in one process (round-robin medians, several calls per
timing at small sizes): the ``topk`` compressor and each SIDCo variant forced onto its
statistical path at every size (``exact_below=0``), beside the variant with its
default ``exact_below``. A variant's ``crossover`` is the smallest size from which its
statistical path is cheaper than ``topk`` at that and every larger size measured;
each variant's ``crossover`` class attribute (``exact_below``'s default) comes from it.
``--clock cpu`` times with the process's CPU time instead of the wall clock: on a
machine loaded by other jobs the wall clock measures the scheduler, while the CPU time
of these single-threaded calls is what a quiet machine's wall clock would show.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import gradsift
from gradsift.tools.benchmarking import INPUT_DESCRIPTION, interleaved_medians_ms, synthetic_gradient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

VARIANTS = ("sidco-exp", "sidco-gpareto", "sidco-gamma")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exponents", type=float, nargs="+", default=[e / 4 for e in range(52, 89)],
                        help="sizes 2^e (default: 2^13 .. 2^22 in quarter octaves)")  # fmt: skip
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    stamp = provenance.start(seeds=[0])  # synthetic_gradient's seed
    rows = []
    for exponent in args.exponents:
        numel = round(2**exponent)
        x = synthetic_gradient(numel)
        compressors = {"topk": gradsift.get_compressor("topk", ratio=args.ratio)}
        for name in VARIANTS:
            compressors[f"{name} statistical"] = gradsift.get_compressor(
                name, ratio=args.ratio, exact_below=0
            )
            compressors[name] = gradsift.get_compressor(name, ratio=args.ratio)
        methods = {name: (lambda c=c, x=x: c.compress(x)) for name, c in compressors.items()}
        inner = max(1, (1 << 17) // numel)
        medians = interleaved_medians_ms(methods, args.repeats, inner=inner, warmup=6, clock=clock)
        rows.append({"numel": numel, "median_ms": medians})
        print(f"n={numel:>9,}  " + "  ".join(f"{name} {ms:.3f}" for name, ms in medians.items()), flush=True)
    crossover = {}
    for name in VARIANTS:
        cheaper = [r["median_ms"][f"{name} statistical"] < r["median_ms"]["topk"] for r in rows]
        crossover[name] = next((rows[i]["numel"] for i in range(len(rows)) if all(cheaper[i:])), None)
        print(f"{name}: statistical path cheaper than topk from n = {crossover[name]} on")
    if args.json:
        report = {"args": {**vars(args), "json": str(args.json)}, "input": INPUT_DESCRIPTION,
                  "crossover": crossover, "rows": rows, "provenance": stamp.finish()}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
