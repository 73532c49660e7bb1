"""Bytes padded to capacity over bytes sent, for the compressors whose capacity follows their demand.

A compressor without a ratio (``vgc``, ``threshold``: ``adaptive_capacity``) sends a
payload whose capacity is the last kept step's largest demand
(:mod:`gradsift.hook.capacity`); room that the step's data does not fill travels as
zeros. Two more VGC arms weigh the ways around it: ``padding_target=1.1`` (capacities
below the demand, entries beyond them wait) against ``alpha=6`` (fewer entries chosen),
by the bytes on the wire per step and the accuracy. For each configuration and seed
this runs ``gradsift train`` (localhost gloo, 2 workers) and reads rank 0's per-step
telemetry: padded over sent is ``sum(bytes_padded) / sum(bytes_sent)`` over the steps
from ``--skip`` on (the first steps start from ``first_ratio``), with the final test
accuracy. Usage (repository root):

    flock /tmp/gradsift-cpu.lock python benchmarks/vgc/padding.py --json results/vgc/padding.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

#: (label, compressor, its options): VGC at the paper's alpha, a fixed threshold at about 2 % density on the
#: MLP, VGC with its padding bounded (the hook's ``padding_target``), and VGC at a higher alpha, the
#: control that sends fewer bytes by sending fewer entries instead.
CONFIGS = (
    ("vgc-alpha4", "vgc", ("alpha=4",)),
    ("threshold-0.1", "threshold", ("threshold=0.1",)),
    ("vgc-alpha4-padding1.1", "vgc", ("alpha=4", "padding_target=1.1")),
    ("vgc-alpha6", "vgc", ("alpha=6",)),
)


def padding(steps: list[dict[str, Any]], skip: int) -> float:
    """``sum(bytes_padded) / sum(bytes_sent)`` over ``steps[skip:]``."""
    kept = steps[skip:]
    return sum(s["bytes_padded"] for s in kept) / sum(s["bytes_sent"] for s in kept)


def run(
    compressor: str, options: tuple[str, ...], seed: int, out: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One ``gradsift train`` run: its padded over sent, accuracy and bytes per step."""
    command = [sys.executable, "-m", "gradsift", "train", "--model", args.model, "--workers", "2",
               "--steps", str(args.steps), "--seed", str(seed), "--compressor", compressor, "--no-progress",
               "--out", str(out), *(f"--option={option}" for option in options)]  # fmt: skip
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=args.timeout)
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "padded_over_sent": padding(steps, args.skip),
        "final_test_accuracy": summary["final_test_accuracy"],
        "bytes_sent_per_step": summary["bytes_sent_per_step"],
        "bytes_padded_per_step": summary["bytes_padded_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="mlp", help="gradsift train's --model (default: mlp)")
    parser.add_argument("--steps", type=int, default=600, help="steps per run (default: 600)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the ratio (default: 5)")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds one run may take (default: 1800)"
    )
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.steps <= args.skip or args.skip < 0:
        parser.error("--steps must exceed --skip, and --skip must be at least 0")
    stamp = provenance.start(seeds=args.seeds)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, compressor, options in CONFIGS:
            runs = [
                run(compressor, options, seed, Path(tmp) / f"{label}-{seed}", args) for seed in args.seeds
            ]
            ratios = [r["padded_over_sent"] for r in runs]
            accuracies = [r["final_test_accuracy"] for r in runs]
            wire = [r["bytes_padded_per_step"] for r in runs]
            results[label] = {
                "compressor": compressor,
                "options": list(options),
                "padded_over_sent_mean": statistics.mean(ratios),
                "padded_over_sent_sd": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_sd": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "bytes_padded_per_step_mean": statistics.mean(wire),
                "runs": runs,
            }
            print(f"{label}: padded / sent {statistics.mean(ratios):.3f} over seeds {args.seeds}", flush=True)
    stamp.write(args.json, args, results=results)


if __name__ == "__main__":
    main()
