"""The training benchmark over seeds: VGG at 100 Mbit/s, fp32 against bf16 and the compressed arms.

``run_benchmark.py``'s main grid at 100 Mbit/s (VGG-style CNN, 4 workers, 200 steps, evaluated
every 25, its learning rate and warm-up) for its five arms -- ``none`` (stock DDP's fp32
allreduce), ``bf16``, ``sidco-exp`` and ``topk`` at ratio 0.01 under DGC's recipe, and ``vgc``
at its defaults -- once per seed, a seed's arms in turn so that the runs compared share an hour. The
controls of this workload (the recipe run dense, one worker alone) are
``benchmarks/auto/vgg_controls.py``'s runs: the same flags on localhost, seeds 0-4, their
accuracy not depending on the link.

Per seed the target is that seed's fp32 final test accuracy less one point (as in
``run_benchmark.py``), and each arm's time to it the training time of its first evaluation at
or above it (evaluation excluded). The JSON holds each run's figures and, per arm, the
paired ratios of fp32's and bf16's time to the target over the arm's (how many times sooner,
the mean over the seeds where both reached it, 95 % t-interval) and the final accuracy's
difference from fp32's (points, paired). Each run's ``summary.json`` and ``evals.jsonl`` are
kept in ``--runs/<arm>-s<seed>/``. Usage (repository root, root for the emulated links, a
clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/training/seeds.py --json results/training/seeds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gradsift.tools.train.summary import time_to_accuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "auto"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
from intervals import bounds
from paths import results_dir
from run_benchmark import COMPRESSORS, MAIN
from time_to_target import paired, read_evals
from vgg_seeds import train_kept

BANDWIDTH = "100mbit"
#: Arm -> its flags after the main grid's (later flags win): the main grid's compressors.
ARMS = {name: ["--compressor", name, *flags] for name, flags in COMPRESSORS.items()}
BASELINES = ("none", "bf16")
SEEDS = (0, 1, 2)
RUNS = results_dir(__file__) / "seeds"


def train(arms: list[str], seeds: list[int], runs: Path, resume: bool) -> None:
    """Every arm once per seed over the link, a seed's arms in turn, kept in ``runs/<arm>-s<seed>/``
    (:func:`vgg_seeds.train_kept`: the main grid's flags, the seed and the arm's flags after them)."""
    train_kept({arm: ARMS[arm] for arm in arms}, seeds, runs, extra=("--bandwidth", BANDWIDTH), resume=resume)


def read(run: Path) -> dict[str, Any]:
    """A kept run's summary and its evaluations."""
    return {"summary": json.loads((run / "summary.json").read_text()), "evals": read_evals(run)}


def summarize(arms: list[str], seeds: list[int], runs: Path) -> dict[str, Any]:
    """Per seed the target; per arm each run's figures, the paired ratios and accuracy differences."""
    data = {arm: {seed: read(runs / f"{arm}-s{seed}") for seed in seeds} for arm in arms}
    targets = {seed: data["none"][seed]["summary"]["final_test_accuracy"] - 0.01 for seed in seeds}
    times = {
        arm: [time_to_accuracy(data[arm][seed]["evals"], targets[seed]) for seed in seeds] for arm in arms
    }
    table = {}
    for arm in arms:
        summaries = [data[arm][seed]["summary"] for seed in seeds]
        entry: dict[str, Any] = {
            "time_to_target_s": times[arm],
            "final_test_accuracy": [s["final_test_accuracy"] for s in summaries],
            "step_time_median_s": statistics.median(s["step_time_median_s"] for s in summaries),
            "bytes_sent_per_step": statistics.fmean(s["bytes_sent_per_step"] for s in summaries),
            "bytes_received_per_step": statistics.fmean(s["bytes_received_per_step"] for s in summaries),
            "compression_factor": statistics.fmean(s["compression_factor"] for s in summaries),
            "seeds_reaching_target": sum(t is not None for t in times[arm]),
        }
        if arm != "none":
            points = [100 * (s["final_test_accuracy"] - data["none"][seed]["summary"]["final_test_accuracy"])
                      for seed, s in zip(seeds, summaries, strict=True)]  # fmt: skip
            entry["points_vs_none"] = dict(zip(("mean", "low", "high"), bounds(points), strict=True))
            entry["sooner_than"] = {
                base: paired(times[base], times[arm]) for base in BASELINES if base != arm
            }
        table[arm] = entry
    return {"bandwidth": BANDWIDTH, "main": MAIN, "seeds": seeds, "targets": targets, "arms": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms (default: all)"
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds (default: %(default)s)"
    )
    parser.add_argument(
        "--runs", type=Path, default=RUNS, help="where the runs are kept (default: %(default)s)"
    )
    parser.add_argument("--resume", action="store_true", help="skip the runs kept already (default: off)")
    parser.add_argument("--summarize-only", action="store_true", help="read the kept runs, train none")
    parser.add_argument("--json", type=Path, help="write the summary here (default: none)")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=args.seeds)
    if not args.summarize_only:
        train(args.arms, args.seeds, args.runs, args.resume)
    summary = summarize(args.arms, args.seeds, args.runs)
    for arm, entry in summary["arms"].items():
        sooner = entry.get("sooner_than", {}).get("none")
        ratio = "" if not sooner or sooner["mean"] is None else f", {sooner['mean']:.2f}x sooner than none"
        print(
            f"{arm:>10}: time to target {entry['time_to_target_s']}, accuracy {entry['final_test_accuracy']}{ratio}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "provenance": stamp.finish()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
