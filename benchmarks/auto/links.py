"""``auto`` against every fixed candidate on emulated links: 40-step step times, side by side.

For each link (localhost, then ``tc``-shaped rates between network namespaces) and each
workload -- the protocol's VGG with SGD on 4 workers (``vgg``) and its GPT with AdamW on 2
(``gpt-adamw``) -- this runs ``gradsift train`` for 40 steps (the workload's schedule, no
evaluation) once per arm: every fixed candidate ``auto`` chooses among for the optimizer
(SGD: ``none``, ``bf16``, ``sidco-exp`` at 0.01; AdamW in a 40-step run: ``none``, ``bf16``),
then ``auto`` itself. Each run's median step time, bytes sent and received per step, and
``auto``'s choice are kept; the table is ``auto``'s median step over the fastest fixed
candidate's on the same link (issue 42's target: within 1.05x). ``auto``'s median includes
its measuring steps (up to ``DECIDE_AT + 1``), as a user's run does. Seed 0 only:
these are timings of one machine state, not accuracy.

With ``--repeats N`` every arm runs ``N`` times, the arms in a rotated order each repeat, so
that load which comes and goes hits them alike; an arm's median step is then the median of
its runs' medians, and its run kept in ``runs`` the one with that median (for ``auto``: its
choice and measurements). Each run also records its median over the steps from ``auto``'s
decision on (``settled_median_s``, the same steps for every arm of a repeat), where ``auto``
runs what it chose. Usage (root, a clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/links.py --json results/auto/links.json
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    parser.add_argument("--repeats", type=int, default=1, help="runs per arm, in rotated order (default: 1)")
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
                arms = (*FIXED[workload], "auto")
                repeats = [
                    repeat_once(arms[r % len(arms) :] + arms[: r % len(arms)], Path(tmp) / f"{link}-{workload}-r{r}",
                                WORKERS[workload], settings)
                    for r in range(args.repeats)
                ]  # fmt: skip
                rows.append(row(link, workload, repeats))
                print(json.dumps(rows[-1]["summary"]), flush=True)
    report = {"steps": STEPS, "repeats": args.repeats, "rows": rows, "provenance": stamp.finish()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def repeat_once(
    order: tuple[str, ...], folder: Path, workers: int, settings: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Every arm once, in ``order``; each run with its median over the steps from ``auto``'s
    decision on (``settled_median_s``)."""
    runs = {arm: run(arm, arm, workers, 0, folder / arm, settings) for arm in order}
    settled_from = int((runs["auto"]["auto"] or {}).get("decided_at") or 0)
    for arm, result in runs.items():
        lines = (folder / arm / "steps.jsonl").read_text().splitlines()
        result["settled_from"] = settled_from
        result["settled_median_s"] = statistics.median(
            json.loads(line)["step_s"] for line in lines[settled_from:]
        )
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose median step is the median of the runs' (the lower middle one of an even
    count), with every run's median and settled median beside it."""
    middle = sorted(runs, key=lambda r: r["step_time_median_s"])[(len(runs) - 1) // 2]
    return {
        **middle,
        "repeats_median_s": [r["step_time_median_s"] for r in runs],
        "repeats_settled_median_s": [r["settled_median_s"] for r in runs],
    }


def row(link: str, workload: str, repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One link x workload: every arm's median run, and ``auto``'s median step over the fastest
    fixed one's -- over the whole run, and over the steps from its decision on."""
    runs = {arm: median_run([r[arm] for r in repeats]) for arm in repeats[0]}
    fixed = {arm: r["step_time_median_s"] for arm, r in runs.items() if arm != "auto"}
    fastest = min(fixed, key=lambda arm: fixed[arm])
    settled = {arm: statistics.median(r["repeats_settled_median_s"]) for arm, r in runs.items()}
    auto = runs["auto"]
    summary = {
        "link": link,
        "workload": workload,
        "fastest_fixed": fastest,
        "auto_choice": (auto["auto"] or {}).get("choice"),
        "auto_choices": sorted({str((r["auto"]["auto"] or {}).get("choice")) for r in repeats}),
        "auto_over_fastest": auto["step_time_median_s"] / fixed[fastest],
        "auto_over_none": auto["step_time_median_s"] / fixed["none"],
        "settled_auto_over_fastest": settled["auto"] / min(v for arm, v in settled.items() if arm != "auto"),
    }
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
