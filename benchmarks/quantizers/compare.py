"""The quantizers and PowerSGD beside the dense baselines, ``sidco-exp`` and ``vgc``, over seeds, with controls.

``gradsift train --model mlp --workers 4 --steps 300 --bandwidth 100mbit --target-accuracy 0.8``
(Fashion-MNIST, links shaped to 100 Mbit/s: root) once per arm and seed, the arms of a seed in
turn so that the runs compared share an hour. Each method runs with its one line's defaults
(``sidco-exp`` at ratio 0.01; ``gradsift train``'s recipe: DGC's momentum correction for the
error-feedback methods), PowerSGD at ranks 1, 2, 4 and 8 (``powersgd-r<rank>``; its momentum stays
the optimizer's, so fp32 is PowerSGD run dense). Beside them, two controls:

* ``topk-dense`` -- the recipe run dense: ``topk`` at ratio 1 sends every element, so what the
  error-feedback methods gain or lose against ``none`` splits into the recipe's part and the
  compression's. An accuracy control: it runs on localhost (its allgather of values and
  indices sends twice fp32's bytes, and 300 of its steps over the link would take minutes).
* ``alone`` -- one worker training on its own batch of the same size, no communication (no
  link, nothing sent or received): the accuracy that communicating has to beat, the time no
  link can beat.

Each run's summary (``gradsift train --json``) is kept as ``--runs/<arm>-s<seed>.json``. The
``--json`` summary holds, per arm, the medians over seeds of the bytes each worker sent and
received per step and of the runs' median step and phases, the mean final test accuracy and
its difference from ``none``'s paired per seed (points, 95 % t-interval), the time to the
target per seed with their median (a run that never reaches it counts as later than every
run that does; the median is "not reached" when half the seeds are), and how many times
sooner than ``none`` and ``bf16`` it got there, paired per seed (the mean of the ratios over
the seeds where both reached it, with its 95 % t-interval). Usage (repository root,
a clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/compare.py --json results/quantizers/compare.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gradsift.tools.train.summary import on_the_wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "auto"))
import provenance
from intervals import bounds
from paths import ROOT
from time_to_target import paired

PROTOCOL = ("--model", "mlp", "--workers", "4", "--target-accuracy", "0.8")
BANDWIDTH = "100mbit"
#: Arm -> its flags after :data:`PROTOCOL` (later flags win).
ARMS = {
    "none": ["--compressor", "none"],
    "bf16": ["--compressor", "bf16"],
    "qsgd": ["--compressor", "qsgd"],
    "terngrad": ["--compressor", "terngrad"],
    "signsgd": ["--compressor", "signsgd"],
    "efsignsgd": ["--compressor", "efsignsgd"],
    **{
        f"powersgd-r{rank}": ["--compressor", "powersgd", "--option", f"rank={rank}"] for rank in (1, 2, 4, 8)
    },
    "sidco-exp": ["--compressor", "sidco-exp", "--ratio", "0.01"],
    "vgc": ["--compressor", "vgc"],
    "topk-dense": ["--compressor", "topk", "--ratio", "1.0"],
    "alone": ["--compressor", "none", "--workers", "1"],
}
#: The arms that run on localhost, without the emulated link.
WITHOUT_LINK = ("topk-dense", "alone")
SEEDS = (0, 1, 2)
RUNS = ROOT / "results" / "quantizers" / "runs"
#: The baselines each arm's time to the target is paired against.
BASELINES = ("none", "bf16")
#: The summary fields whose median over the seeds an arm reports (the phases are the runs' medians).
MEDIAN_FIELDS = ("bytes_sent_per_step", "bytes_received_per_step", "compression_factor", "step_time_median_s",
                 "compress_median_s", "communicate_median_s", "decompress_median_s")  # fmt: skip
#: The summary fields kept per run.
FIELDS = (*MEDIAN_FIELDS, "final_test_accuracy", "time_to_accuracy_s")


def command(arm: str, seed: int, steps: int, out: Path, json_path: Path) -> list[str]:
    """The ``gradsift train`` command line of ``arm`` at ``seed``."""
    link = [] if arm in WITHOUT_LINK else ["--bandwidth", BANDWIDTH]
    return [sys.executable, "-m", "gradsift", "train", *PROTOCOL, "--steps", str(steps), *link, *ARMS[arm],
            "--seed", str(seed), "--no-progress", "--out", str(out), "--json", str(json_path)]  # fmt: skip


def train(arms: list[str], seeds: list[int], steps: int, runs: Path, resume: bool, timeout: float) -> None:
    """Run every arm once per seed (a seed's arms in turn), keeping ``runs/<arm>-s<seed>.json``;
    with ``resume``, a run whose file is there already is skipped."""
    runs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm in arms:
                kept = runs / f"{arm}-s{seed}.json"
                if resume and kept.is_file():
                    print(f"= {kept} (done)", flush=True)
                    continue
                line = command(arm, seed, steps, Path(tmp) / f"{arm}-s{seed}", kept)
                print("+", " ".join(line), flush=True)
                subprocess.run(line, check=True, timeout=timeout)


def median_time(times: list[float | None]) -> float | None:
    """The median of times to the target, a run that never reached it counting as infinitely late."""
    middle = statistics.median(math.inf if t is None else t for t in times)
    return None if math.isinf(middle) else middle


def summarize(arms: list[str], seeds: list[int], runs: Path) -> dict[str, Any]:
    """Per arm: each seed's :data:`FIELDS`, their medians, and the accuracy paired against ``none``'s."""
    per_arm = {
        arm: {seed: on_the_wire(json.loads((runs / f"{arm}-s{seed}.json").read_text())) for seed in seeds}
        for arm in arms
    }
    table = {}
    for arm, by_seed in per_arm.items():
        entry: dict[str, Any] = {"flags": ARMS[arm], "link": None if arm in WITHOUT_LINK else BANDWIDTH}
        entry["runs"] = {str(seed): {key: run.get(key) for key in FIELDS} for seed, run in by_seed.items()}
        for key in MEDIAN_FIELDS:
            entry[key] = statistics.median(run[key] for run in by_seed.values())
        entry["final_test_accuracy"] = statistics.fmean(
            run["final_test_accuracy"] for run in by_seed.values()
        )
        times = [run["time_to_accuracy_s"] for run in by_seed.values()]
        entry["time_to_accuracy_s"] = median_time(times)
        entry["seeds_reaching_target"] = sum(t is not None for t in times)
        if arm != "none" and "none" in per_arm:
            points = [
                100 * (by_seed[s]["final_test_accuracy"] - per_arm["none"][s]["final_test_accuracy"])
                for s in seeds
            ]
            entry["accuracy_points_vs_none"] = dict(zip(("mean", "low", "high"), bounds(points), strict=True))
        entry["sooner_than"] = {
            base: paired([per_arm[base][s]["time_to_accuracy_s"] for s in seeds], times)
            for base in BASELINES
            if base in per_arm and base != arm
        }
        table[arm] = entry
    return {"protocol": [*PROTOCOL], "bandwidth": BANDWIDTH, "seeds": seeds, "arms": table}


def report(summary: dict[str, Any]) -> None:
    """One line per arm on stdout."""
    for arm, entry in summary["arms"].items():
        reached = entry["time_to_accuracy_s"]
        versus = entry.get("accuracy_points_vs_none")
        paired = (
            ""
            if versus is None
            else " ({mean:+.2f} [{low:+.2f}, {high:+.2f}] points vs none)".format(**versus)
        )
        print(
            f"{arm:>11}: {entry['bytes_sent_per_step']:9.0f} B sent, {entry['bytes_received_per_step']:9.0f} B received"
            f" per step, step {1e3 * entry['step_time_median_s']:6.1f} ms, accuracy {entry['final_test_accuracy']:.4f}"
            f"{paired}, to 0.8 "
            + ("not reached" if reached is None else f"{reached:.1f} s")
            + f" ({entry['seeds_reaching_target']}/{len(summary['seeds'])} seeds)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        help="arms to run (default: all)")  # fmt: skip
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default: %(default)s)")
    parser.add_argument(
        "--runs", type=Path, default=RUNS, help="where each run's summary goes (default: %(default)s)"
    )
    parser.add_argument("--json", type=Path, help="write the summary over seeds here (default: none)")
    parser.add_argument(
        "--resume", action="store_true", help="skip the runs whose summary is in --runs (default: off)"
    )
    parser.add_argument("--summarize-only", action="store_true", help="read the runs in --runs, train none")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default: %(default)s)")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=args.seeds)
    if not args.summarize_only:
        train(args.arms, args.seeds, args.steps, args.runs, args.resume, args.timeout)
    summary = summarize(args.arms, args.seeds, args.runs)
    report(summary)
    if args.json is not None:
        summary["steps"] = args.steps
        args.json.write_text(json.dumps({**summary, "provenance": stamp.finish()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
