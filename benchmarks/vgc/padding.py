"""Bytes padded to capacity over bytes sent, for the compressors whose capacity follows their demand.

A compressor without a ratio (``vgc``, ``threshold``: ``adaptive_capacity``) sends a
payload whose capacity is the last kept step's largest demand
(:mod:`gradsift.hook.capacity`); room that the step's data does not fill travels as
zeros. Two more VGC arms weigh the ways around it: ``padding_target=1.1`` (capacities
below the demand, entries beyond them wait) against ``alpha=6`` (fewer entries chosen),
by the bytes on the wire per step and the accuracy. For each configuration and seed
this trains the run ``gradsift train`` builds from its printed command line (localhost
gloo, 2 workers) and reads rank 0's per-step telemetry: padded over sent is
``sum(bytes_padded) / sum(bytes_sent)`` over the steps from ``--skip`` on (the first steps
start from ``first_ratio``), with the final test accuracy. The controls train the same
model in the same run: fp32 (``none``), ``bf16`` and one worker alone (no communication,
the zero-byte run). The runs with the same number of workers train in turn in one launch
of the workers (:func:`gradsift.tools.train.launcher.run_trainings`: a run seeds its model
and data order, so it trains as in processes of its own); a vanished peer ends a launch
after ``gradsift train``'s process-group timeout. Usage (repository root):

    flock /tmp/gradsift-cpu.lock python benchmarks/vgc/padding.py --json results/vgc/padding.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

from gradsift.tools.cli import build_parser
from gradsift.tools.commands.train import check_devices, config_from_args
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.launcher import run_trainings
from gradsift.tools.train.summary import bytes_sent, single_worker

#: (label, compressor, its options, workers): the controls -- fp32, bf16 and one worker alone with no
#: communication -- then VGC at the paper's alpha, a fixed threshold at about 2 % density on the MLP, VGC
#: with its padding bounded (the hook's ``padding_target``), and VGC at a higher alpha, the arm that sends
#: fewer bytes by sending fewer entries instead.
CONFIGS = (
    ("fp32", "none", (), 2),
    ("bf16", "bf16", (), 2),
    ("alone", "none", (), 1),
    ("vgc-alpha4", "vgc", ("alpha=4",), 2),
    ("threshold-0.1", "threshold", ("threshold=0.1",), 2),
    ("vgc-alpha4-padding1.1", "vgc", ("alpha=4", "padding_target=1.1"), 2),
    ("vgc-alpha6", "vgc", ("alpha=6",), 2),
)


def padding(steps: list[dict[str, Any]], skip: int) -> float:
    """``sum(bytes_padded) / sum(bytes_sent)`` over ``steps[skip:]``."""
    kept = steps[skip:]
    return sum(s["bytes_padded"] for s in kept) / sum(s["bytes_sent"] for s in kept)


def train_config(
    compressor: str, options: tuple[str, ...], workers: int, seed: int, out: Path, args: argparse.Namespace
) -> TrainConfig:
    """The config ``gradsift train`` builds from one run's command line, which is printed."""
    command = ["train", "--model", args.model, "--workers", str(workers), "--steps", str(args.steps),
               "--seed", str(seed), "--compressor", compressor, "--no-progress", "--out", str(out),
               *(f"--option={option}" for option in options),
               *(["--data-dir", args.data_dir] if args.data_dir else [])]  # fmt: skip
    print("+ gradsift", " ".join(command), flush=True)
    return config_from_args(build_parser().parse_args(command), str(out), workers)


def measure(out: Path, seed: int, skip: int) -> dict[str, Any]:
    """One finished run's padded over sent, accuracy and bytes per step (one worker alone
    sends nothing: no ratio, no bytes)."""
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    lone = single_worker(summary)
    return {
        "seed": seed,
        "padded_over_sent": None if lone else padding(steps, skip),
        "final_test_accuracy": summary["final_test_accuracy"],
        "bytes_sent_per_step": bytes_sent(summary),
        "bytes_padded_per_step": 0.0 if lone else summary["bytes_padded_per_step"],
    }


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="mlp", help="gradsift train's --model (default: mlp)")
    parser.add_argument("--data-dir", help="gradsift train's --data-dir (default: its search path)")
    parser.add_argument("--steps", type=int, default=600, help="steps per run (default: 600)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the ratio (default: 5)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.steps <= args.skip or args.skip < 0:
        parser.error("--steps must exceed --skip, and --skip must be at least 0")
    stamp = provenance.start(seeds=args.seeds)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = [
            train_config(compressor, options, workers, seed, Path(tmp) / f"{label}-{seed}", args)
            for label, compressor, options, workers in CONFIGS
            for seed in args.seeds
        ]
        for workers in sorted({config.workers for config in configs}, reverse=True):
            check_devices(workers, configs[0].device)
            launch = [config for config in configs if config.workers == workers]
            run_trainings(launch, Path(tmp) / f"launch-{workers}-workers")
        for label, compressor, options, workers in CONFIGS:
            runs = [measure(Path(tmp) / f"{label}-{seed}", seed, args.skip) for seed in args.seeds]
            accuracy = mean_sd([r["final_test_accuracy"] for r in runs])
            results[label] = {
                "compressor": compressor,
                "options": list(options),
                "workers": workers,
                "accuracy_mean": accuracy[0],
                "accuracy_sd": accuracy[1],
                "bytes_padded_per_step_mean": statistics.mean(r["bytes_padded_per_step"] for r in runs),
                "runs": runs,
            }
            if workers > 1:
                ratio = mean_sd([r["padded_over_sent"] for r in runs])
                results[label].update(padded_over_sent_mean=ratio[0], padded_over_sent_sd=ratio[1])
                print(f"{label}: padded / sent {ratio[0]:.3f} over seeds {args.seeds}", flush=True)
            print(f"{label}: test accuracy {accuracy[0]:.4f} +- {accuracy[1]:.4f}", flush=True)
    stamp.write(args.json, args, results=results)


if __name__ == "__main__":
    main()
