"""PowerSGD's rank on three workloads, over seeds, beside fp32, bf16 and one worker alone.

PowerSGD sends each layer's gradient matrix as rank-``r`` factors and keeps what they miss in
the error; which ``r`` a user meets by default decides whether the one line trains. Ranks 1, 2,
4 and 8, seeds 0-2, each with ``gradsift train``'s defaults otherwise, on:

* ``mlp`` -- the quantizer comparison (``compare.py``: 4 workers, 300 steps, 100 Mbit/s); its
  arms ``powersgd-r<rank>`` run into its ``runs/``, beside its fp32, bf16 and ``alone`` runs.
* ``vgg`` -- the time-to-target composition's VGG + SGD (4 workers, 200 steps, localhost),
  beside the candidates' fp32 and bf16 runs and ``vgg_controls.py``'s worker alone.
* ``gpt-adamw`` -- the convergence protocol's GPT + AdamW (2 workers, 314 steps, localhost),
  beside its fp32, bf16 and ``alone`` runs, and the recipe run dense (``topk-dense``: ``topk``
  at ratio 1 under the same frozen-variance AdamW the recipe gives PowerSGD), and ranks 1, 2
  and 4 two ways out of that recipe (rank 8 the first way only): ``-no-recipe`` (plain AdamW steps on the exchanged mean gradient,
  PowerSGD's error feedback on the gradient: the way PyTorch's hook is used) and
  ``-no-masking`` (the recipe's frozen-variance AdamW without DGC's momentum factor masking).
  The committed GPT runs of the plain ``powersgd-r<rank>`` and ``-no-masking`` arms are of
  4ee3f54 and 622122c, before 177799b left AdamW its moments under PowerSGD; run again, both repeat the
  ``-no-recipe`` arm, which is what the one line does since (docs/decisions.md, "PowerSGD
  leaves Adam to the optimizer").

Under SGD PowerSGD leaves the momentum to the optimizer, so PowerSGD run dense *is* fp32 there.
The baselines are committed runs of earlier commits; ``repeat`` reruns fp32 at seed 0 of VGG and
the GPT here, to show that pairing against them is pairing against this code.

The ``--json`` summary holds per workload and arm each seed's metric (final test accuracy; for
the GPT the final validation loss), its mean, its difference from fp32's paired per seed (points
of accuracy, or % of fp32's loss; 95 % t-interval), on how many seeds it beats the worker alone,
and the medians of the bytes each worker sent and received per step. Usage (a clean checkout of
a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/powersgd_rank.py --json results/quantizers/powersgd_rank.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gradsift.tools.train.summary import on_the_wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "auto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convergence"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare
import provenance
import vgg_controls
from intervals import bounds
from paths import ROOT
from protocol import RUNS as PROTOCOL_RUNS
from protocol import WORKLOADS
from vgg_seeds import train_kept

RANKS = (1, 2, 4)
SEEDS = (0, 1, 2)
RUNS = ROOT / "results" / "quantizers" / "powersgd_rank"
#: PowerSGD's arms: its one line at each rank.
RANK_ARMS = {f"powersgd-r{rank}": compare.ARMS[f"powersgd-r{rank}"] for rank in RANKS}
#: The arms each workload trains here, beyond the ranks (``repeat``: at seed 0 only).
#: Rank 8, past the default (added after the first batch): the one line under SGD, and under AdamW
#: AdamW keeping its moments, which is the one line since 177799b.
RANK_8 = {"powersgd-r8": compare.ARMS["powersgd-r8"]}
OWN_ARMS = {
    "mlp": RANK_8,
    "vgg": {**RANK_8, "repeat": ["--compressor", "none"]},
    "gpt-adamw": {
        "topk-dense": ["--compressor", "topk", "--ratio", "1.0"],
        "repeat": ["--compressor", "none"],
        "powersgd-r8-no-recipe": [*RANK_8["powersgd-r8"], "--no-recipe"],
        # the two ways out of the recipe's frozen-variance AdamW with momentum masking
        **{f"{arm}-no-recipe": [*flags, "--no-recipe"] for arm, flags in RANK_ARMS.items()},
        **{
            f"{arm}-no-masking": [*flags, "--option", "momentum_masking=false"]
            for arm, flags in RANK_ARMS.items()
        },
    },
}
#: Per workload: the summary field compared, and whether lower is better.
METRIC = {"mlp": ("final_test_accuracy", False), "vgg": ("final_test_accuracy", False),
          "gpt-adamw": ("final_test_loss", True)}  # fmt: skip
BASELINES = ("none", "bf16", "alone")


def run_summary(workload: str, arm: str, seed: int) -> dict[str, Any]:
    """The ``summary.json`` of ``arm``'s run at ``seed`` (the committed baselines where they lie);
    a worker alone sends and receives nothing."""
    if workload == "mlp":
        path = compare.RUNS / f"{arm}-s{seed}.json"
    elif arm in BASELINES and workload == "vgg":
        directory = (
            vgg_controls.RUNS / f"alone-s{seed}" if arm == "alone" else vgg_controls.candidate_run(arm, seed)
        )
        path = directory / "summary.json"
    elif arm in BASELINES:
        path = PROTOCOL_RUNS / workload / f"{arm}-e{WORKLOADS[workload].epochs:g}-s{seed}" / "summary.json"
    else:
        path = RUNS / workload / f"{arm}-s{seed}" / "summary.json"
    return on_the_wire(json.loads(path.read_text()))


def train(workloads: list[str], seeds: list[int], resume: bool, timeout: float) -> None:
    """Each workload's rank arms once per seed (a seed's arms in turn), then its own arms."""
    for workload in workloads:
        if workload == "mlp":
            compare.train([*RANK_ARMS, *OWN_ARMS["mlp"]], seeds, 300, compare.RUNS, resume, timeout)
            continue
        own = OWN_ARMS[workload]
        arms = {**RANK_ARMS, **{arm: flags for arm, flags in own.items() if arm != "repeat"}}
        train_kept(arms, seeds, RUNS / workload, resume=resume, workload=workload)
        if 0 in seeds:
            train_kept({"repeat": own["repeat"]}, [0], RUNS / workload, resume=resume, workload=workload)


def summarize_workload(workload: str, seeds: list[int]) -> dict[str, Any]:
    """Per arm: each seed's metric and bytes, the mean, the gap to fp32 paired per seed (points of
    accuracy, or % of fp32's loss), the seeds it beats the worker alone on, the bytes' medians."""
    field, lower_is_better = METRIC[workload]
    arms = [*BASELINES, *RANK_ARMS, *(arm for arm in OWN_ARMS.get(workload, {}) if arm != "repeat")]
    runs = {arm: {seed: run_summary(workload, arm, seed) for seed in seeds} for arm in arms}
    metric = {arm: {seed: run[field] for seed, run in by_seed.items()} for arm, by_seed in runs.items()}
    table = {}
    for arm, by_seed in runs.items():
        value = metric[arm]
        entry: dict[str, Any] = {
            "runs": {str(s): value[s] for s in seeds},
            "mean": statistics.fmean(value.values()),
        }
        if arm != "none":
            gaps = [
                100 * (value[s] / metric["none"][s] - 1)
                if lower_is_better
                else 100 * (value[s] - metric["none"][s])
                for s in seeds
            ]
            entry["vs_none"] = dict(zip(("mean", "low", "high"), bounds(gaps), strict=True))
        if arm != "alone":
            entry["seeds_beating_alone"] = sum(
                (value[s] < metric["alone"][s]) if lower_is_better else (value[s] > metric["alone"][s])
                for s in seeds
            )
        for key in ("bytes_sent_per_step", "bytes_received_per_step"):
            entry[key] = statistics.median(run[key] for run in by_seed.values())
        table[arm] = entry
    summary: dict[str, Any] = {"metric": field, "unit": "% of fp32's loss" if lower_is_better else "points",
                               "arms": table}  # fmt: skip
    repeat = RUNS / workload / "repeat-s0" / "summary.json"
    if workload != "mlp" and 0 in seeds and repeat.is_file():
        summary["repeat_seed0"] = {
            "committed": metric["none"][0],
            "rerun": json.loads(repeat.read_text())[field],
        }
    return summary


def report(summary: dict[str, Any]) -> None:
    """One line per workload and arm on stdout."""
    for workload, entry in summary["workloads"].items():
        print(f"{workload} ({entry['metric']}, gaps in {entry['unit']}):")
        for arm, row in entry["arms"].items():
            versus = row.get("vs_none")
            gap = "" if versus is None else " {mean:+.2f} [{low:+.2f}, {high:+.2f}]".format(**versus)
            beats = (
                "" if "seeds_beating_alone" not in row else f", beats alone on {row['seeds_beating_alone']}"
            )
            print(f"  {arm:>13}: {row['mean']:.4f}{gap}{beats}, {row['bytes_sent_per_step']:10.0f} B sent, "
                  f"{row['bytes_received_per_step']:10.0f} B received per step")  # fmt: skip
        if "repeat_seed0" in entry:
            print(
                "  fp32 seed 0, committed / rerun: {committed:.4f} / {rerun:.4f}".format(
                    **entry["repeat_seed0"]
                )
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(METRIC), choices=list(METRIC),
                        help="workloads (default: %(default)s)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), choices=SEEDS,
                        help="seeds (default: %(default)s)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the summary here (default: none)")
    parser.add_argument("--resume", action="store_true", help="skip the runs already kept (default: off)")
    parser.add_argument("--summarize-only", action="store_true", help="read the kept runs, train none")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per MLP run (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=args.seeds)
    if not args.summarize_only:
        train(args.workloads, args.seeds, args.resume, args.timeout)
    summary = {
        "ranks": list(RANKS),
        "seeds": args.seeds,
        "workloads": {workload: summarize_workload(workload, args.seeds) for workload in args.workloads},
    }
    report(summary)
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "provenance": stamp.finish()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
