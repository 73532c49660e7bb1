"""Does DGC's recipe at 1 % train a second CNN in fewer steps than fp32, as it trains VGG?

On VGG + SGD (4 workers) the fixed ``sidco-exp`` -- momentum correction with masking, at 1 % --
reaches fp32's accuracy less half a point in fewer steps than fp32 (``vgg_longer.py``: 0.81x
the steps over seeds 0-4 at 1,000 steps), which ``auto``'s choice by the step does not weigh:
one workload is not a rule. This trains ResNet-20 (BatchNorm, residual blocks; Fashion-MNIST)
with the composition's VGG flags and only the model changed -- fp32 (``none``), ``sidco-exp``
(``--ratio 0.01``) and the VGG controls (``vgg_controls.CONTROLS``: ``topk`` at ratio 1 under
the recipe, the method run dense; ``sidco-exp`` without the recipe; one worker alone, no
communication) -- for ``--steps`` (1,000) evaluated every ``--eval-every`` (50), seeds 0-2,
into ``results/auto/second_cnn/<arm>-s<seed>/`` (summary and evaluations; each batch's stamp in
``provenance-s<seed>*.json``). It resumes as ``vgg_longer.py`` does, so it can run at ``nice -n
19`` as a background campaign; its timings are not read. ``analyze`` reports each arm's steps to
the target (fp32's final accuracy, the mean over the seeds, less half a point) and its mean
accuracy over the second half of the run with the paired difference from fp32's
(``vgg_longer.per_step``). Usage (a clean checkout of a commit on main)::

    nice -n 19 python benchmarks/auto/second_cnn.py run
    python benchmarks/auto/second_cnn.py analyze --json results/auto/second_cnn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
import vgg_longer
from paths import ROOT
from vgg_controls import CONTROLS

MODEL = "resnet20"
ARMS = {
    "none": ["--compressor", "none"],
    "sidco-exp": ["--compressor", "sidco-exp", "--ratio", "0.01"],
    **CONTROLS,
}
SEEDS = (0, 1, 2)
RUNS = ROOT / "results" / "auto" / "second_cnn"


def bytes_per_step(arms: list[str], seeds: list[int], out: Path) -> dict[str, dict[str, list[float]]]:
    """Per arm and seed, what each worker sent and received per step (``gradsift train``'s
    summary: the mean over the run)."""
    summaries = {
        arm: [json.loads((out / f"{arm}-s{s}" / "summary.json").read_text()) for s in seeds] for arm in arms
    }
    return {
        arm: {way: [summary[f"bytes_{way}_per_step"] for summary in runs] for way in ("sent", "received")}
        for arm, runs in summaries.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "analyze"))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="default: %(default)s")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="default: %(default)s")
    parser.add_argument("--steps", type=int, default=vgg_longer.STEPS, help="default: %(default)s")
    parser.add_argument("--eval-every", type=int, default=vgg_longer.EVAL_EVERY, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=RUNS, help="where the runs are (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="analyze: write the result here")
    args = parser.parse_args(argv)
    if args.action == "run":
        arms = {arm: ARMS[arm] for arm in args.arms}
        vgg_longer.run(arms, args.seeds, args.out, args.steps, args.eval_every, model=MODEL)
        return 0
    stamp = provenance.start(seeds=args.seeds)
    runs = vgg_longer.curves(tuple(args.arms), args.seeds, args.out, MODEL)
    result = {
        **vgg_longer.per_step(runs, args.seeds, MODEL),
        "bytes_per_step": bytes_per_step(args.arms, args.seeds, args.out),
    }
    vgg_longer.print_per_step(result)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"model": MODEL, **result, "provenance": stamp.finish()}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
