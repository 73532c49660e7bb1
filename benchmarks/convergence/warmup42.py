"""Issue 42, item 3: the 1-bit Adam arm with its dense warm-up measured against the fixed 64 steps.

On the protocol's ``gpt-adamw`` screen (2 workers, 314 steps, seeds 0-2), the ``onebit-adam``
method (``efsignsgd`` with the frozen-variance AdamW) twice per seed: ``measured`` -- no
``warmup_steps`` (``--option warmup_steps=null``: the hook ends the warm-up when Adam's second
moment has settled, ``gradsift.hook.adam_warmup``) -- and ``fixed64`` -- ``--dense-warmup-steps 64``,
what the one line took before. Each run is one ``gradsift train`` through ``run.execute`` (held
under ``/tmp/gradsift-cpu.lock``, stamped by ``benchmarks/provenance.py``).

    PYTHONPATH=$WT/src python benchmarks/convergence/warmup42.py run --root MAIN/results/convergence/warmup
    python benchmarks/convergence/warmup42.py table --root MAIN/results/convergence/warmup
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from protocol import METHODS, RESULTS, WORKLOADS
from run import execute, finished

WORKLOAD, METHOD, SEEDS = "gpt-adamw", "onebit-adam", (0, 1, 2)
ARMS = {"measured": ("--option", "warmup_steps=null"), "fixed64": ("--dense-warmup-steps", "64")}
ROOT = RESULTS / "warmup"


@dataclass(frozen=True)
class Run:
    """One run: ``arm`` of :data:`ARMS` at ``seed``, under ``root/runs/``."""

    arm: str
    seed: int
    root: Path = ROOT
    workload: str = WORKLOAD

    @property
    def directory(self) -> Path:
        return self.root / "runs" / f"{METHOD}-{self.arm}-s{self.seed}"

    def arguments(self) -> list[str]:
        workload = WORKLOADS[WORKLOAD]
        return [*workload.train_arguments(workload.epochs), *METHODS[METHOD].train_arguments(),
                *ARMS[self.arm], "--seed", str(self.seed)]  # fmt: skip


def table(root: Path) -> str:
    """Final validation loss, bytes received per step and the warm-up's end, per seed and arm,
    with the paired difference of the losses (measured - fixed64)."""
    rows = ["| seed | arm | warm-up end | final val loss | bytes received / step | fewer bytes |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    losses: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in SEEDS:
        for arm in ARMS:
            summary = json.loads((Run(arm, seed, root).directory / "summary.json").read_text())
            recipe = summary["recipe"]
            end = recipe.get("adam_warmup", {}).get("end", recipe["adam_warmup_steps"])
            received = summary["bytes_received_per_step"]
            losses[arm].append(summary["final_test_loss"])
            rows.append(f"| {seed} | {arm} | {end} | {summary['final_test_loss']:.4f} | {received:,.0f} | "
                        f"{summary['dense_bytes_per_step'] / received:.2f}x |")  # fmt: skip
    diffs = [a - b for a, b in zip(losses["measured"], losses["fixed64"], strict=True)]
    rows.append(f"\npaired measured - fixed64: mean {statistics.mean(diffs):+.4f}, per seed "
                + ", ".join(f"{d:+.4f}" for d in diffs))  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=("run", "table"))
    parser.add_argument("--root", type=Path, default=ROOT, help="where runs/ goes (default: %(default)s)")
    args = parser.parse_args()
    if args.action == "table":
        print(table(args.root))
        return 0
    plan = [Run(arm, seed, args.root) for seed in SEEDS for arm in ARMS]
    failures = [run for run in plan if not finished(run) and not execute(run, timed=True)]
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
