"""Run the convergence protocol (resumable): every planned run that has no summary yet.

    nice -n 19 python benchmarks/convergence/run.py study          # fp32 curves that decide the epochs
    nice -n 19 python benchmarks/convergence/run.py accuracy       # the campaign, in priority order
    nice -n 19 python benchmarks/convergence/run.py accuracy --no-ef   # methods without error feedback
    nice -n 19 python benchmarks/convergence/run.py defaults       # one epoch, trainer defaults (VGG)
    nice -n 19 python benchmarks/convergence/run.py adamw          # GPT with AdamW (2 workers), DiLoCo
    python benchmarks/convergence/run.py timing                    # step times over emulated links (root)
    python benchmarks/convergence/run.py validation                # full emulated runs (root)
    python benchmarks/convergence/run.py status                    # what is done, what is left

``timing`` and ``validation`` measure time: each run holds ``/tmp/gradsift-cpu.lock``
(taken here, one run at a time, so others can interleave). Every finished run's
summary.json carries a ``provenance`` stamp (``benchmarks/provenance.py``: the commit, the
command, the seed, the load averages before and after, whether the lock was held).

Each run is ``python -m gradsift train ... --out results/convergence/runs/<workload>/<method>-e<E>-s<seed>``
in its own process (4 workers, or the workload's own count, on localhost gloo). A finished run keeps config.json,
summary.json, evals.jsonl and steps.jsonl.gz (gzipped: ``analyze.py`` reads it); a run
that fails is reported and the next one starts, so re-running the same command
completes the campaign.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance
from protocol import (
    DEFAULTS_RUNS,
    METHODS,
    RESULTS,
    VALIDATION_RUNS,
    WORKLOADS,
    accuracy_runs,
    adamw_runs,
    study_runs,
    timing_runs,
)

CPU_LOCK = Path("/tmp/gradsift-cpu.lock")


def finished(run) -> bool:
    return (run.directory / "summary.json").is_file() and (run.directory / "steps.jsonl.gz").is_file()


@contextlib.contextmanager
def cpu_lock():
    """Hold the shared CPU lock for one timed run (other jobs interleave between runs)."""
    with open(CPU_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pack(directory: Path) -> None:
    """A finished run as it is committed: its steps gzipped, its per-rank logs dropped."""
    steps = directory / "steps.jsonl"
    with open(steps, "rb") as source, gzip.open(f"{steps}.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    steps.unlink()
    shutil.rmtree(directory / "logs", ignore_errors=True)


def execute(run, timed: bool = False) -> bool:
    """Run one training; on success gzip its steps and drop the per-rank logs."""
    run.directory.mkdir(parents=True, exist_ok=True)
    arguments = run.arguments()
    command = [sys.executable, "-m", "gradsift", "train", *arguments, "--out", str(run.directory),
               "--no-progress", "--timeout", "1800"]  # fmt: skip
    started = time.monotonic()
    print(
        f"[{time.strftime('%H:%M:%S')}] start {run.workload}/{run.directory.name}: {' '.join(command[3:])}",
        flush=True,
    )
    with cpu_lock() if timed else contextlib.nullcontext():
        stamp = provenance.start(seeds=[int(arguments[arguments.index("--seed") + 1])])
        result = subprocess.run(command, capture_output=True, text=True)
        record = stamp.finish()
    took = time.monotonic() - started
    if result.returncode != 0:
        print(f"  FAILED after {took:.0f} s:\n{result.stderr[-3000:]}", flush=True)
        return False
    provenance.stamp_file(run.directory / "summary.json", record)
    pack(run.directory)
    print(f"  done in {took:.0f} s: {result.stdout.strip().splitlines()[0]}", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "group", choices=("study", "accuracy", "defaults", "adamw", "timing", "validation", "status")
    )
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="only these workloads")
    parser.add_argument("--method", action="append", choices=sorted(METHODS), help="only these methods")
    feedback = parser.add_mutually_exclusive_group()
    feedback.add_argument("--no-ef", action="store_true", help="only methods without error feedback")
    feedback.add_argument("--ef", action="store_true", help="only methods with error feedback")
    args = parser.parse_args()
    ef = True if args.ef else False if args.no_ef else None
    groups = {
        "study": study_runs, "accuracy": lambda: accuracy_runs(ef), "validation": lambda: VALIDATION_RUNS,
        "defaults": lambda: DEFAULTS_RUNS, "adamw": adamw_runs,
        "timing": lambda: [t for t in timing_runs() if ef is None or METHODS[t.method].error_feedback == ef],
    }  # fmt: skip
    names = list(groups) if args.group == "status" else [args.group]
    plan = [run for name in names for run in groups[name]()]
    plan = [r for r in plan if (not args.workload or r.workload in args.workload)
            and (not args.method or r.method in args.method)]  # fmt: skip
    plan = list(dict.fromkeys(plan))
    if args.group == "status":
        for run in plan:
            print(f"{'done' if finished(run) else 'todo'}  {run.directory.relative_to(RESULTS)}")
        return 0
    timed = args.group in ("timing", "validation")
    failures = [run for run in plan if not finished(run) and not execute(run, timed)]
    print(
        f"{len(plan) - len(failures)} of {len(plan)} runs finished; failed: {[str(r.directory) for r in failures]}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
