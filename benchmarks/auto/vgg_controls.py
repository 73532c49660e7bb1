"""Controls for the VGG row ``auto`` misses: is ``sidco-exp``'s earlier arrival its compression?

On VGG + SGD (4 workers, 200 steps, evaluated every 25) the fixed ``sidco-exp`` reaches the
time-to-target composition's target in fewer steps than fp32 on every seed run, so on
localhost, where ``auto`` keeps stock DDP for its faster step, the fixed method arrives
sooner. ``sidco-exp`` there runs DGC's recipe (``gradsift train``'s default): SGD's momentum
moves into the exchange as momentum correction with momentum factor masking. Two controls
separate the recipe's optimizer dynamics from the compression, with the same flags and seeds
as the candidates' runs (``vgg_seeds.py``), and the zero-communication run beside them:

* ``topk-dense`` -- the method run dense: ``topk`` at ratio 1 under the same recipe. Every
  element is sent every step, so masking zeroes the velocity each step: SGD without momentum.
* ``sidco-exp-no-recipe`` -- the compression without the recipe: ``sidco-exp`` at 0.01 with
  plain error feedback, SGD keeping its momentum.
* ``alone`` -- one worker training on its own batch of the same size, no communication.

Per arm and seed the runs go to ``results/auto/vgg_controls/<arm>-s<seed>/`` (summary and
evaluations), and ``--json`` gets, beside the candidates' runs already committed (seed 0 from
the main grid's 1 Gbit/s runs, whose curves do not depend on the link; seeds 1-4 from
``vgg_seeds/``), every arm's steps
to the composed target, the bytes each worker sent and received per step, and its mean
accuracy over the evaluations from step 100 on (a measure less coarse than the first
evaluation past the target), the latter also as a
difference from fp32's (``none``) paired per seed, with its 95 % t-interval. Usage (a clean checkout of
a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/vgg_controls.py --json results/auto/vgg_controls.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
import time_to_target as composed
from intervals import bounds
from paths import ROOT
from vgg_seeds import train_kept
from whole import goal

CONTROLS = {
    "topk-dense": ["--compressor", "topk", "--ratio", "1.0"],
    "sidco-exp-no-recipe": ["--compressor", "sidco-exp", "--ratio", "0.01", "--no-recipe"],
    "alone": ["--compressor", "none", "--workers", "1"],  # the last --workers wins
}
CANDIDATES = ("none", "bf16", "sidco-exp")
SEEDS = (*composed.VGG_SEEDS, *composed.VGG_MORE_SEEDS)
RUNS = ROOT / "results" / "auto" / "vgg_controls"
#: The evaluations whose mean accuracy is reported: from this step on.
LATE_FROM = 100


def candidate_run(arm: str, seed: int) -> Path:
    """A candidate's committed run: seed 0 from the main grid, the others from vgg_seeds/."""
    if seed == 0:
        return composed.VGG_RUNS / f"{arm}-w4-{composed.VGG_LINK}"
    return composed.VGG_SEED_RUNS / f"{arm}-s{seed}"


def summarize(arms: list[str], seeds: list[int], out: Path) -> dict[str, Any]:
    """Per arm: steps to the composed target and late mean accuracy, per seed."""
    target = goal("vgg")
    table = {}
    for arm in [*CANDIDATES, *arms]:
        per_seed = {}
        for seed in seeds:
            run = candidate_run(arm, seed) if arm in CANDIDATES else out / f"{arm}-s{seed}"
            curve = composed.points("vgg", composed.read_evals(run))
            run_summary = json.loads((run / "summary.json").read_text())
            per_seed[seed] = {
                "steps_to_target": composed.step_to_target("vgg", curve, target),
                "late_mean_accuracy": statistics.fmean(v for step, v in curve if step >= LATE_FROM),
                "final_accuracy": curve[-1][1],
                # per worker and step, mean over the run (``gradsift train``'s summary)
                "bytes_sent_per_step": run_summary["bytes_sent_per_step"],
                "bytes_received_per_step": run_summary["bytes_received_per_step"],
            }
        table[arm] = per_seed
    versus = {}
    for arm, per_seed in table.items():
        if arm != "none":
            points = [
                100 * (per_seed[s]["late_mean_accuracy"] - table["none"][s]["late_mean_accuracy"])
                for s in seeds
            ]
            versus[arm] = dict(zip(("mean", "low", "high"), bounds(points), strict=True))
    return {"target": target, "late_from_step": LATE_FROM, "seeds": seeds, "arms": table,
            "late_points_vs_none": versus}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(CONTROLS), choices=list(CONTROLS),
                        help="control arms to run (default: %(default)s)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), choices=SEEDS,
                        help="seeds (default: %(default)s)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RUNS, help="where the runs go (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--summarize-only", action="store_true", help="read the runs in --out, train none")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=args.seeds)
    if not args.summarize_only:
        train_kept({arm: CONTROLS[arm] for arm in args.arms}, args.seeds, args.out)
    summary = summarize(args.arms, args.seeds, args.out)
    for arm, per_seed in summary["arms"].items():
        steps = [entry["steps_to_target"] for entry in per_seed.values()]
        late = statistics.fmean(entry["late_mean_accuracy"] for entry in per_seed.values())
        versus = summary["late_points_vs_none"].get(arm)
        paired = (
            ""
            if versus is None
            else " ({mean:+.2f} [{low:+.2f}, {high:+.2f}] points vs none)".format(**versus)
        )
        print(f"{arm:>20}: steps to {summary['target']:.4f} {steps}, late mean accuracy {late:.4f}{paired}")
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "provenance": stamp.finish()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
