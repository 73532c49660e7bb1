"""VGC on Fashion-MNIST: bytes on the wire and test accuracy after one epoch, 4 workers.

Runs ``gradsift train`` (localhost gloo, VGG-style CNN, full Fashion-MNIST, one epoch,
seed 0) for fp32 dense, ``vgc`` at each alpha, then ``sidco-exp`` and ``topk`` at the
ratio that matches the bytes per step of ``vgc`` at ``--match-alpha`` (8 bytes per
sparsifier element vs VGC's 4), and writes a summary JSON. Usage (repository root):

    flock /tmp/gradsift-cpu.lock python benchmarks/vgc/accuracy.py --out results/vgc/accuracy.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

FIELDS = ("bytes_sent_per_step", "dense_bytes_per_step", "achieved_density", "step_time_median_s",
          "final_test_accuracy", "train_time_s", "parameters", "steps")  # fmt: skip


def train(name: str, run_dir: Path, args: argparse.Namespace, *extra: str) -> dict:
    """One ``gradsift train`` run; returns its summary.json."""
    command = [sys.executable, "-m", "gradsift", "train", "--model", args.model, "--workers", str(args.workers),
               "--epochs", str(args.epochs), "--eval-every", "0", "--seed", "0", "--no-progress",
               "--data-dir", args.data_dir, "--out", str(run_dir / name), *extra]  # fmt: skip
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads((run_dir / name / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--match-alpha", type=float, default=2.0)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/gradsift-vgc-accuracy"))
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "accuracy.json")
    args = parser.parse_args()
    stamp = provenance.start(seeds=[0])  # every run's --seed

    rows = {"none": train("none", args.runs, args, "--compressor", "none")}
    for alpha in args.alphas:
        rows[f"vgc alpha={alpha:g}"] = train(f"vgc-{alpha:g}", args.runs, args, "--compressor", "vgc",
                                             "--option", f"alpha={alpha}")  # fmt: skip
    matched = rows[f"vgc alpha={args.match_alpha:g}"]
    ratio = matched["bytes_sent_per_step"] / (8 * matched["parameters"])
    for name in ("sidco-exp", "topk"):
        rows[f"{name} ratio={ratio:.4g}"] = train(
            name, args.runs, args, "--compressor", name, "--ratio", str(ratio)
        )

    dense = rows["none"]
    table = {
        name: {
            **{k: s.get(k) for k in FIELDS},
            "fewer_bytes_than_fp32": dense["dense_bytes_per_step"] / s["bytes_sent_per_step"],
            "accuracy_minus_fp32": s["final_test_accuracy"] - dense["final_test_accuracy"],
        }
        for name, s in rows.items()
    }
    result = {"model": args.model, "workers": args.workers, "epochs": args.epochs, "matched_ratio": ratio,
              "runs": table, "provenance": stamp.finish()}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in table.items():
        print(f"{name:24s} {row['fewer_bytes_than_fp32']:8.1f}x fewer bytes  "
              f"acc {row['final_test_accuracy']:.4f} ({row['accuracy_minus_fp32']:+.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
