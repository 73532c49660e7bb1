"""VGC on Fashion-MNIST: bytes on the wire and test accuracy after one epoch, 4 workers, over seeds.

Runs ``gradsift train`` (localhost gloo, VGG-style CNN, full Fashion-MNIST, one epoch) once per
arm and seed: fp32 (``none``), ``bf16``, ``vgc`` at each alpha; then ``sidco-exp`` and ``topk``
at the ratio that matches the bytes per step of ``vgc`` at ``--match-alpha`` (8 bytes per
sparsifier element against VGC's 4; the mean over the seeds' runs); and three controls:

* ``vgc alpha=0`` -- VGC without its variance test: every element passes it, and what is sent
  is what VGC's 4-bit codes can carry (the elements within 2^7.5 of the largest), so what VGC
  loses against fp32 splits into the test's part and the codes'.
* ``topk ratio=1`` -- the sparsifiers' recipe (DGC's momentum correction) run dense.
* ``alone`` -- one worker training on its own batch of the same size for the same steps, no
  communication (nothing sent or received).

Per arm the JSON holds each seed's summary fields and, over the seeds, the mean bytes sent and
received per step and worker, the mean density and final test accuracy, the median of the
runs' median steps, and the accuracy's difference from fp32's paired per seed (points, 95 %
t-interval). Usage (repository root, a clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/vgc/accuracy.py --out results/vgc/accuracy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gradsift.tools.train.summary import on_the_wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "auto"))
import provenance
from intervals import bounds
from paths import results_dir

FIELDS = ("bytes_sent_per_step", "bytes_received_per_step", "dense_bytes_per_step", "achieved_density",
          "step_time_median_s", "final_test_accuracy", "train_time_s", "parameters", "steps")  # fmt: skip
#: The control that sends nothing: one worker.
ALONE = "alone"


def train(name: str, seed: int, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One ``gradsift train`` run of ``--epochs``, or of the steps ``extra`` names (its
    summary.json kept in ``--runs``; reused with ``--resume``)."""
    out = args.runs / f"{name.replace(' ', '-')}-s{seed}"
    if args.resume and (out / "summary.json").is_file():
        print(f"= {out} (done)", flush=True)
    else:
        command = [sys.executable, "-m", "gradsift", "train", "--model", args.model, "--workers", str(args.workers),
                   *([] if "--steps" in extra else ["--epochs", str(args.epochs)]), "--eval-every", "0",
                   "--seed", str(seed), "--no-progress", "--data-dir", args.data_dir, "--out", str(out), *extra]  # fmt: skip
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, timeout=args.timeout)
    return on_the_wire(json.loads((out / "summary.json").read_text()))


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm: each seed's :data:`FIELDS`, the means and median over seeds, the paired difference from fp32."""
    dense = runs["none"]
    table = {}
    for name, by_seed in runs.items():
        seeds = sorted(by_seed)
        sent = statistics.fmean(by_seed[s]["bytes_sent_per_step"] for s in seeds)
        points = [100 * (by_seed[s]["final_test_accuracy"] - dense[s]["final_test_accuracy"]) for s in seeds]
        mean, low, high = bounds(points)
        table[name] = {
            "seeds": {str(s): {k: by_seed[s].get(k) for k in FIELDS} for s in seeds},
            "bytes_sent_per_step": sent,
            "bytes_received_per_step": statistics.fmean(by_seed[s]["bytes_received_per_step"] for s in seeds),
            "fewer_bytes_than_fp32": dense[seeds[0]]["dense_bytes_per_step"] / sent if sent else None,
            "achieved_density": statistics.fmean(by_seed[s]["achieved_density"] for s in seeds),
            "step_time_median_s": statistics.median(by_seed[s]["step_time_median_s"] for s in seeds),
            "final_test_accuracy": statistics.fmean(by_seed[s]["final_test_accuracy"] for s in seeds),
            "points_vs_fp32": {"mean": mean, "low": low, "high": high},
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="vgg", help="the trainer's model (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, help="workers (default: %(default)s)")
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs per run (default: %(default)s)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: %(default)s)"
    )
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="VGC's alphas (default: %(default)s)")  # fmt: skip
    parser.add_argument("--match-alpha", type=float, default=2.0,
                        help="the alpha whose bytes the sparsifiers match (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--data-dir", default="/usr/share/datasets/fashion-mnist", help="(default: %(default)s)"
    )
    parser.add_argument("--runs", type=Path, default=Path("/tmp/gradsift-vgc-accuracy"),
                        help="where each run goes (default: %(default)s)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="reuse the runs found in --runs (default: off)")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per run (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "accuracy.json",
                        help="the summary (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()
    stamp = provenance.start(seeds=args.seeds)

    arms: dict[str, list[str]] = {"none": ["--compressor", "none"], "bf16": ["--compressor", "bf16"]}
    arms |= {f"vgc alpha={a:g}": ["--compressor", "vgc", "--option", f"alpha={a}"] for a in args.alphas}
    runs = {
        name: {seed: train(name, seed, args, *flags) for seed in args.seeds} for name, flags in arms.items()
    }
    matched = runs[f"vgc alpha={args.match_alpha:g}"]
    ratio = statistics.fmean(s["bytes_sent_per_step"] / (8 * s["parameters"]) for s in matched.values())
    steps = str(runs["none"][args.seeds[0]]["steps"])
    later = {
        "sidco-exp matched": ["--compressor", "sidco-exp", "--ratio", str(ratio)],
        "topk matched": ["--compressor", "topk", "--ratio", str(ratio)],
        "vgc alpha=0": ["--compressor", "vgc", "--option", "alpha=0"],
        "topk ratio=1": ["--compressor", "topk", "--ratio", "1.0"],
        ALONE: ["--compressor", "none", "--workers", "1", "--steps", steps],
    }
    runs |= {
        name: {seed: train(name, seed, args, *flags) for seed in args.seeds} for name, flags in later.items()
    }

    table = summarize(runs)
    result = {"model": args.model, "workers": args.workers, "epochs": args.epochs, "seeds": args.seeds,
              "matched_ratio": ratio, "runs": table, "provenance": stamp.finish()}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in table.items():
        versus = row["points_vs_fp32"]
        print(f"{name:18s} {row['bytes_sent_per_step']:10.0f} B sent {row['bytes_received_per_step']:10.0f} B received"
              f"  acc {row['final_test_accuracy']:.4f} ({versus['mean']:+.2f} [{versus['low']:+.2f}, "
              f"{versus['high']:+.2f}] points)")  # fmt: skip


if __name__ == "__main__":
    main()
