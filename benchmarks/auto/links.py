"""``auto`` against every fixed candidate on emulated links: 40-step step times, side by side.

For each link (localhost, then ``tc``-shaped rates between network namespaces) and each
workload -- the protocol's VGG with SGD on 4 workers (``vgg``) and its GPT with AdamW on 2
(``gpt-adamw``) -- this runs ``gradsift train`` for 40 steps (the workload's schedule, no
evaluation) once per arm: every fixed candidate ``auto`` chooses among for the optimizer
(SGD: ``none``, ``bf16``, ``sidco-exp`` at 0.01; AdamW in a 40-step run: ``none``, ``bf16``),
then ``auto`` itself. Each run's median step time, bytes sent and received per step, and
``auto``'s choice are kept; the table is ``auto``'s median step over the fastest fixed
candidate's on the same link (issue 42's target: within 1.05x). ``auto``'s median includes
its dense measuring steps (the first ``DECIDE_AT``), as a user's run does. Seed 0 only:
these are timings of one machine state, not accuracy. Usage (root, a clean checkout of a
commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/links.py --json results/auto/links.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, the protocol
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
from one_line import run

#: Per workload: the fixed candidates ``auto`` chooses among there (``--compressor`` values).
FIXED = {"vgg": ("none", "bf16", "sidco-exp"), "gpt-adamw": ("none", "bf16")}
#: Workers per workload (the protocol's).
WORKERS = {"vgg": 4, "gpt-adamw": 2}
LINKS = ("localhost", "1gbit", "100mbit", "10mbit")
STEPS = 40


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=list(LINKS), help="links (default: %(default)s)")
    parser.add_argument(
        "--workloads", nargs="+", default=list(FIXED), help="workloads (default: %(default)s)"
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default: 1200)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=[0])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in args.links:
            for workload in args.workloads:
                settings = argparse.Namespace(
                    workload=workload, steps=STEPS, timeout=args.timeout,
                    bandwidth=None if link == "localhost" else link,
                )  # fmt: skip
                runs = {
                    arm: run(arm, arm, WORKERS[workload], 0, Path(tmp) / f"{link}-{workload}-{arm}", settings)
                    for arm in (*FIXED[workload], "auto")
                }
                rows.append(row(link, workload, runs))
                print(json.dumps(rows[-1]["summary"]), flush=True)
    report = {"steps": STEPS, "rows": rows, "provenance": stamp.finish()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def row(link: str, workload: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One link x workload: every run, and ``auto``'s median step over the fastest fixed one's."""
    fixed = {arm: r["step_time_median_s"] for arm, r in runs.items() if arm != "auto"}
    fastest = min(fixed, key=lambda arm: fixed[arm])
    auto = runs["auto"]
    summary = {
        "link": link,
        "workload": workload,
        "fastest_fixed": fastest,
        "auto_choice": (auto["auto"] or {}).get("choice"),
        "auto_over_fastest": auto["step_time_median_s"] / fixed[fastest],
        "auto_over_none": auto["step_time_median_s"] / fixed["none"],
    }
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
