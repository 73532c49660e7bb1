"""One whole run of ``auto`` per link, against the time to the target composed for it.

Issue 42 asks that ``auto``'s time to the target, composed from the candidates' curves and
their 40-step timings (``time_to_target.py``), be checked by one whole run of ``auto`` per
link. This runs it: per link (localhost, then ``tc``-shaped rates between network
namespaces) and workload, ``gradsift train --compressor auto`` for the whole run whose
curves the composition reads, seed 0 -- VGG + SGD on 4 workers with
``benchmarks/training/run_benchmark.py``'s main grid (200 steps, evaluated every 25), the
GPT + AdamW on 2 with the convergence protocol's ``gpt-adamw`` (314 steps, every 104). Its
measured time to the target is the training time (``train_time_s``, evaluations excluded, as
the composition's steps x median step) at the first evaluation at or past the composition's
target; the table sets it beside the composed time of seed 0 (``measured / composed``; they
agree when within :data:`AGREE`). Usage (root, a clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/whole.py --json results/auto/whole.json

With ``--compressors auto sidco-exp`` each link x workload also runs the fixed candidate
whole, beside ``auto`` in the same session: the issue's comparison measured rather than composed.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convergence"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
import run_benchmark
import time_to_target as composed
from protocol import WORKLOADS

LINKS = ("localhost", "1gbit", "100mbit", "10mbit")
#: Measured over composed within this factor either way: the composition is confirmed.
AGREE = 0.10


def train_flags(workload: str) -> list[str]:
    """The ``gradsift train`` flags of the run whose curves the composition reads (no seed)."""
    if workload == "vgg":  # its seed 0 stands; the command's own --seed 0 repeats it
        main = run_benchmark.MAIN
        return [*run_benchmark.COMMON, "--workers", str(main["workers"]), "--steps", str(main["steps"]),
                "--eval-every", str(main["eval_every"])]  # fmt: skip
    spec = WORKLOADS[workload]
    return spec.train_arguments(spec.epochs)


def goal(workload: str) -> float:
    """The composition's target for ``workload`` (fp32's final metric, less its margin)."""
    if workload == "vgg":
        curves, _ = composed.vgg_curves(("none",))
    else:
        curves = composed.gpt_curves(("none",))
    return composed.target(workload, curves["none"])[1]


def measured(workload: str, evals: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """``(step, train_time_s)`` of the first evaluation at or past ``target`` (None: never)."""
    step = composed.step_to_target(workload, composed.points(workload, evals), target)
    return step, next((float(e["train_time_s"]) for e in evals if e["step"] == step), None)


def whole_run(
    link: str, workload: str, target: float, out: Path, timeout: float, compressor: str = "auto"
) -> dict[str, Any]:
    """One run of ``workload`` with ``compressor`` over ``link``, seed 0: what ran (``auto``'s
    choice), its time to ``target`` and its evaluations."""
    command = [sys.executable, "-m", "gradsift", "train", *train_flags(workload), "--seed", "0",
               "--compressor", compressor, "--no-progress", "--out", str(out)]  # fmt: skip
    command += [] if link == "localhost" else ["--bandwidth", link]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    evals = composed.read_evals(out)
    step, seconds = measured(workload, evals, target)
    auto = (summary.get("recipe") or {}).get("auto") or {}
    return {
        "compressor": compressor,
        "choice": auto.get("choice", compressor),
        "decided_at": auto.get("decided_at"),
        "curve": composed.points(workload, evals),
        "steps_to_target": step,
        "time_to_target_s": seconds,
        "train_time_s": summary["train_time_s"],
        "step_time_median_s": summary["step_time_median_s"],
    }


def compare(row: dict[str, Any], composition: dict[str, Any], compressor: str = "auto") -> dict[str, Any]:
    """The whole run of ``compressor`` beside the composed seed-0 time of the same link and
    workload (``auto``'s, or that fixed candidate's)."""
    seed0 = composition["seeds"].index(0)
    composed_arm = composition["auto"] if compressor == "auto" else composition["fixed"][compressor]
    composed_s = composed_arm["time_to_target_s"][seed0]
    ratio = (
        None
        if composed_s is None or row["time_to_target_s"] is None
        else row["time_to_target_s"] / composed_s
    )
    return {
        "composed_s": composed_s,
        "composed_choice": composition["auto"]["choice"] if compressor == "auto" else compressor,
        "measured_over_composed": ratio,
        "agree": None if ratio is None else abs(ratio - 1.0) <= AGREE,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=list(LINKS), help="links (default: %(default)s)")
    parser.add_argument(
        "--workloads", nargs="+", default=["vgg", "gpt-adamw"], help="workloads (default: %(default)s)"
    )
    parser.add_argument(
        "--composed",
        type=Path,
        default=composed.OUT_JSON,
        help="time_to_target.py's result (default: %(default)s)",
    )
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=["auto"],
        help="what each link x workload runs, in turn: auto and fixed candidates (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default: 1200)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args(argv)
    compositions = {(r["link"], r["workload"]): r for r in json.loads(args.composed.read_text())["rows"]}
    stamp = provenance.start(seeds=[0])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in args.links:
            for workload in args.workloads:
                target = goal(workload)
                for compressor in args.compressors:
                    row = {"link": link, "workload": workload, "target": target}
                    out = Path(tmp) / f"{link}-{workload}-{compressor}"
                    row.update(whole_run(link, workload, target, out, args.timeout, compressor))
                    row.update(compare(row, compositions[(link, workload)], compressor))
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    report = {
        "agree_within": AGREE,
        "composed": {"path": composed.shown(args.composed), "sha256": composed.digest(args.composed)},
        "rows": rows,
        "provenance": stamp.finish(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
