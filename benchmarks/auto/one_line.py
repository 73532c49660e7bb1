"""The one line, ``register_comm_hook(ddp)`` (``compressor="auto"``), against stock DDP on one link.

For each seed this runs ``gradsift train`` with the GPT + AdamW workload of the convergence
protocol (``gpt-adamw``: 2 workers, its learning-rate schedule and clipping) once per arm,
side by side: ``none`` (stock DDP's fp32 allreduce: the baseline), ``bf16`` (the cheap
control), ``auto`` (what the one line does: measure, then run what it predicts fastest),
and one worker alone (the zero-communication control, per-worker batch). Each run's final
validation loss, median step time, wall time, bytes sent and received per step, and what
``auto`` chose are kept; the paired per-seed ratios to ``none`` are summarised. With
``--bandwidth`` the two workers talk over emulated links (``gradsift train --bandwidth``:
network namespaces + tc; root). Usage (repository root, a clean checkout of a commit on main):

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/one_line.py --json results/auto/localhost.json
    flock /tmp/gradsift-cpu.lock python benchmarks/auto/one_line.py --bandwidth 100mbit \\
        --json results/auto/100mbit.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, the protocol
import provenance
from convergence.protocol import WORKLOADS
from intervals import bounds

#: (label, ``--compressor``, workers): the baseline, the cheap control, the one line, no communication.
ARMS = (("none", "none", 2), ("bf16", "bf16", 2), ("auto", "auto", 2), ("alone", "none", 1))


def run(
    label: str, compressor: str, workers: int, seed: int, out: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One ``gradsift train`` run of the workload and what it measured."""
    workload = WORKLOADS[args.workload]
    flags = workload.train_arguments(workload.epochs, steps=getattr(args, "steps", None))
    flags[flags.index("--workers") + 1] = str(workers)
    command = [sys.executable, "-m", "gradsift", "train", *flags, "--seed", str(seed), "--compressor", compressor,
               "--no-progress", "--out", str(out)]  # fmt: skip
    if args.bandwidth and workers > 1:
        command += ["--bandwidth", args.bandwidth]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=args.timeout)
    summary = json.loads((out / "summary.json").read_text())
    auto = (summary.get("recipe") or {}).get("auto")
    return {
        "arm": label,
        "seed": seed,
        "final_validation_loss": summary["final_test_loss"],
        "step_time_median_s": summary["step_time_median_s"],
        "wall_time_s": summary["wall_time_s"],
        "bytes_sent_per_step": summary["bytes_sent_per_step"] if workers > 1 else 0.0,
        "bytes_received_per_step": summary.get("bytes_received_per_step", 0.0) if workers > 1 else 0.0,
        "auto": auto,
    }


def paired(runs: list[dict[str, Any]], arm: str, field: str) -> list[float]:
    """Per seed, ``arm``'s ``field`` over ``none``'s (seeds where both ran)."""
    by_seed = {(r["arm"], r["seed"]): r[field] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    return [
        by_seed[(arm, s)] / by_seed[("none", s)]
        for s in seeds
        if (arm, s) in by_seed and ("none", s) in by_seed
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload", default="gpt-adamw", choices=sorted(WORKLOADS), help="protocol workload"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--bandwidth", help="emulated link rate, e.g. 100mbit (default: localhost)")
    parser.add_argument("--arms", nargs="+", default=[a[0] for a in ARMS], help="arms to run (default: all)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default: 1800)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=args.seeds)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # arms side by side within a seed: the same load for the pair
            for label, compressor, workers in ARMS:
                if label in args.arms:
                    runs.append(run(label, compressor, workers, seed, Path(tmp) / f"{label}-{seed}", args))
    ratios = {
        arm: {field: bounds(paired(runs, arm, field)) for field in ("final_validation_loss", "step_time_median_s", "wall_time_s")}
        for arm in args.arms
        if arm != "none"
    }  # fmt: skip
    report = {"workload": args.workload, "bandwidth": args.bandwidth, "runs": runs, "ratios_to_none": ratios}
    report["provenance"] = stamp.finish()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    for arm, fields in ratios.items():
        cells = ", ".join(f"{field} {m:.3f}x [{lo:.3f}, {hi:.3f}]" for field, (m, lo, hi) in fields.items())
        print(f"{arm} / none: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
