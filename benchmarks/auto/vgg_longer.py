"""The VGG composition at five times the length: does ``sidco-exp``'s lead per step last?

On the composition's VGG + SGD runs (4 workers, 200 steps, evaluated every 25) the fixed
``sidco-exp`` -- DGC's momentum correction with masking, at 1 % -- reaches fp32's accuracy
less half a point in fewer steps than fp32 on every seed run (``vgg_controls.py``: the
combination of recipe and compression, not either alone), so on localhost, where ``auto``
keeps stock DDP for its faster step, the fixed method arrives sooner. This trains the same
fixed candidates (``none``, ``bf16``, ``sidco-exp``, the composition's flags) for
``--steps`` (1,000: about two epochs) evaluated every ``--eval-every`` (50), seeds 0-4, into
``results/auto/vgg_longer/<arm>-s<seed>/`` (summary and evaluations; each seed's stamp in
``provenance-s<seed>.json``). It resumes: a run whose summary is there is not trained again,
so it can run at ``nice -n 19`` as a background campaign (``gradsift train``'s timings are
not read: the step times are ``links.json``'s, as in the composition).

``analyze`` composes these curves with each link's committed step times exactly as
``time_to_target.py`` composes the 200-step ones (its target: fp32's final accuracy, the mean
over the seeds, less half a point), and sets beside them each arm's mean accuracy over the
second half of the run and its paired difference from fp32's. Usage (a clean checkout of a
commit on main)::

    nice -n 19 python benchmarks/auto/vgg_longer.py run
    python benchmarks/auto/vgg_longer.py analyze --json results/auto/vgg_longer.json
"""

from __future__ import annotations

import argparse
import itertools
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
from vgg_seeds import ARMS, train_kept
from whole import run_benchmark

RUNS = ROOT / "results" / "auto" / "vgg_longer"
SEEDS = (*composed.VGG_SEEDS, *composed.VGG_MORE_SEEDS)
STEPS, EVAL_EVERY = 1000, 50


def run(
    arms: dict[str, list[str]], seeds: list[int], out: Path, steps: int, every: int, model: str = "vgg"
) -> None:
    """Train what is missing (``arms``: each arm's flags), seed by seed, stamping each seed's
    batch that trained something in ``provenance-s<seed>.json``, or, beside the ``n - 1`` batches
    of that seed stamped already, ``provenance-s<seed>-<n>.json`` (``model``: the composition's
    flags with another ``--model``)."""
    extra = ("--model", model, "--steps", str(steps), "--eval-every", str(every))
    for seed in seeds:
        stamp = provenance.start(seeds=[seed])
        trained = train_kept(arms, [seed], out, extra, resume=True)
        if trained:
            stamp_path(out, seed).write_text(
                json.dumps({"arms": trained, "provenance": stamp.finish()}, indent=2) + "\n"
            )


def stamp_path(out: Path, seed: int) -> Path:
    """The first free name of ``provenance-s<seed>.json``, ``provenance-s<seed>-2.json``, ..."""
    names = (
        f"provenance-s{seed}.json" if n == 1 else f"provenance-s{seed}-{n}.json" for n in itertools.count(1)
    )
    return next(out / name for name in names if not (out / name).exists())


def curves(
    arms: tuple[str, ...], seeds: list[int], out: Path, workload: str = "vgg"
) -> dict[str, composed.Curve]:
    return {
        arm: {s: composed.points(workload, composed.read_evals(out / f"{arm}-s{s}")) for s in seeds}
        for arm in arms
    }


def second_half(curve: list[tuple[int, float]]) -> float:
    """The mean accuracy over the evaluations in the run's second half."""
    last = curve[-1][0]
    return statistics.fmean(value for step, value in curve if step > last / 2)


def analyze(seeds: list[int], out: Path) -> dict[str, Any]:
    """Every VGG row of the composition's links, composed with the longer curves."""
    links = json.loads(composed.LINKS_JSON.read_text())
    links["rows"] = [r for r in links["rows"] if r["summary"]["workload"] == "vgg"]
    repeated = json.loads(composed.REPEATED_JSON.read_text())
    longer = curves(ARMS, seeds, out)
    rows = composed.analyze_links(links, lambda workload, arms: longer, repeated)
    return {**per_step(longer, seeds, "vgg"), "rows": rows}


def per_step(runs: dict[str, composed.Curve], seeds: list[int], workload: str) -> dict[str, Any]:
    """Each arm's steps to the target (fp32's final accuracy, the mean over ``seeds``, less half a
    point), its mean accuracy over the second half of each run, and that mean's difference from
    fp32's (``runs["none"]``), paired by seed, in points with its 95 % t-interval."""
    final, goal = composed.target(workload, runs["none"])
    late = {arm: [second_half(c[s]) for s in seeds] for arm, c in runs.items()}
    versus = {
        arm: dict(zip(("mean", "low", "high"),
                      bounds([100 * (a - b) for a, b in zip(late[arm], late["none"], strict=True)]), strict=True))
        for arm in runs if arm != "none"
    }  # fmt: skip
    return {
        "seeds": seeds,
        "fp32_final": final,
        "target": goal,
        "steps_to_target": {
            arm: [composed.step_to_target(workload, c[s], goal) for s in seeds] for arm, c in runs.items()
        },
        "second_half_accuracy": late,
        "second_half_points_vs_none": versus,
    }


def print_per_step(result: dict[str, Any]) -> None:
    """:func:`per_step`'s result, a line per arm."""
    print(f"target {result['target']:.4f} (fp32's final {result['fp32_final']:.4f})")
    for arm, steps in result["steps_to_target"].items():
        versus = result["second_half_points_vs_none"].get(arm)
        paired = (
            ""
            if versus is None
            else " ({mean:+.2f} [{low:+.2f}, {high:+.2f}] points vs none)".format(**versus)
        )
        print(f"{arm:>10}: steps to the target {steps}, second-half accuracy "
              f"{statistics.fmean(result['second_half_accuracy'][arm]):.4f}{paired}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "analyze"))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="default: %(default)s")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="default: %(default)s")
    parser.add_argument("--steps", type=int, default=STEPS, help="default: %(default)s")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=RUNS, help="where the runs are (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="analyze: write the result here")
    args = parser.parse_args(argv)
    if args.action == "run":
        arms = {arm: ["--compressor", arm, *run_benchmark.COMPRESSORS[arm]] for arm in args.arms}
        run(arms, args.seeds, args.out, args.steps, args.eval_every)
        return 0
    stamp = provenance.start(seeds=args.seeds)
    result = analyze(args.seeds, args.out)
    print_per_step(result)
    for row in result["rows"]:
        best, none = row["auto_over_best_fixed"], row["auto_over_none"]
        print(f"{row['link']:>9}: best fixed {row['best_fixed']['names']}, auto chose {row['auto']['choice']}, "
              f"auto / best {best['mean']}, auto / none {none['mean']}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "provenance": stamp.finish()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
