"""Communication-bound scaling benchmark: one exchange, 2/4/8/16 emulated workers at 100 Mbit/s.

Each point is one ``gradsift train`` process (the CLI, so ``--exchange`` passes straight
through) training ``mlp-wide`` (1.86M parameters, 784-1024-1024-10) on Fashion-MNIST with
a small per-worker batch, every worker in its own network namespace behind a 100 Mbit/s
link. Per point it records, from the steps after the warm-up: the medians of step,
communicate, compute, compress and decompress time; bytes sent, padded and (when the
hook reports it) received per worker and step; what every host's NIC received and sent
per step (the kernel's veth counters, read between the end of the warm-up step and the
last step); the final test accuracy; the load average and the machine's CPU busy share
during the run; the ``provenance`` stamp (benchmarks/provenance.py: commit, command, machine).
Every run takes the CPU lock for itself (so other jobs interleave between
runs, never inside one).

    python benchmarks/scaling/run.py --label allgather --compressor sidco-exp --ratio 0.01
    python benchmarks/scaling/run.py --label fp32 --compressor none
    python benchmarks/scaling/run.py --label NAME --compressor sidco-exp --ratio 0.01 --exchange NAME
    python benchmarks/scaling/run.py --label fp32 --compressor none --localhost   # CPU floor (no shaping)

Writes ``results/scaling/results/<label>-w<P>[-localhost].json`` and keeps the run
directory under ``results/scaling/runs/`` (``--results DIR``: ``DIR/<name>.json`` and
``DIR/runs/<name>``, for runs kept apart from the timed ones, e.g. on a loaded machine
without the CPU lock).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from gradsift.tools.train.netem import PREFIX, NetemUnavailableError, link_counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

RESULTS = results_dir(__file__)
DATA_DIR = "/usr/share/datasets/fashion-mnist"
MODEL = ["--model", "mlp-wide", "--lr", "0.05", "--seed", "0", "--data-dir", DATA_DIR, "--no-progress",
         "--timeout", "900"]  # fmt: skip
TIMED = ("step_s", "communicate_s", "compute_s", "compress_s", "decompress_s")
COUNTED = ("bytes_sent", "bytes_padded", "bytes_received", "dense_bytes", "density")


@contextmanager
def cpu_lock(path: str | None):
    """Hold ``flock(path)`` (the machine's shared CPU lock) for the duration."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _counters(launcher_pid: int, workers: int) -> list[dict[str, int]]:
    return [link_counters(f"{PREFIX}{launcher_pid}-h{host}") for host in range(workers)]


def run_point(args: argparse.Namespace, workers: int) -> dict:
    """One ``gradsift train`` run at ``workers`` workers; its measurements."""
    name = f"{args.label}-w{workers}" + ("-localhost" if args.localhost else "")
    out = (RESULTS / "runs" if args.results is None else args.results / "runs") / name
    command = [sys.executable, "-m", "gradsift", "train", *MODEL, "--workers", str(workers),
               "--batch-size", str(args.batch_size), "--compressor", args.compressor, "--steps", str(args.steps),
               "--out", str(out)]  # fmt: skip
    if args.ratio is not None:
        command += ["--ratio", str(args.ratio)]
    if args.exchange is not None:
        command += ["--exchange", args.exchange]
    for option in args.option:
        command += ["--option", option]
    if not args.localhost:
        command += ["--bandwidth", args.bandwidth]
    steps_file = out / "steps.jsonl"
    snapshots: dict[int, list[dict[str, int]]] = {}
    with cpu_lock(args.lock):
        stamp, cpu_before = provenance.start(seeds=[0]), cpu_times()  # MODEL's seed
        steps_file.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "launcher.log", "w")  # noqa: SIM115 - closed below
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while launcher.poll() is None:
            done = _lines(steps_file)
            for mark in (args.warmup, args.steps):
                if not args.localhost and done >= mark and mark not in snapshots:
                    with contextlib.suppress(NetemUnavailableError):  # gone: the run is ending
                        snapshots[mark] = _counters(launcher.pid, workers)
            time.sleep(0.02)
        log.close()
        record, cpu_after = stamp.finish(), cpu_times()
    if launcher.returncode != 0:
        raise SystemExit(
            f"{name} failed ({launcher.returncode}):\n{(out / 'launcher.log').read_text()[-3000:]}"
        )
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in steps_file.read_text().splitlines()][args.warmup :]
    result = {
        "name": name, "label": args.label, "compressor": args.compressor, "ratio": args.ratio,
        "exchange": args.exchange, "options": args.option, "workers": workers,
        "bandwidth": None if args.localhost else args.bandwidth, "batch_size": args.batch_size,
        "steps": args.steps, "warmup_steps": args.warmup, "parameters": summary["parameters"],
        "command": command, "final_test_accuracy": summary["final_test_accuracy"],
        "medians": {key: statistics.median(r[key] for r in records) for key in TIMED},
        "means": {key: statistics.fmean(r[key] for r in records) for key in COUNTED if key in records[0]},
        "load_average_before": record["load_before"], "load_average_after": record["load_after"],
        "cpu_busy_share": (cpu_after[0] - cpu_before[0]) / max(cpu_after[1] - cpu_before[1], 1.0),
        "wall_s": record["wall_s"], "cpu_lock": args.lock, "nice": os.nice(0), "provenance": record,
    }  # fmt: skip
    if args.warmup in snapshots and args.steps in snapshots:
        span = args.steps - args.warmup
        first, last = snapshots[args.warmup], snapshots[args.steps]
        result["nic_per_step"] = [
            {key: (b[key] - a[key]) / span for key in ("rx_bytes", "tx_bytes")}
            for a, b in zip(first, last, strict=True)
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", required=True, help="name of the series (<label>-w<P>.json)")
    parser.add_argument("--compressor", required=True)
    parser.add_argument("--ratio", type=float)
    parser.add_argument("--exchange", help="passed as gradsift train --exchange (default: the compressor's)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8, help="first steps left out of the medians")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--localhost", action="store_true", help="no emulation: the CPU-bound floor")
    parser.add_argument("--lock", default="/tmp/gradsift-cpu.lock", help="CPU lock per run ('' for none)")
    parser.add_argument(
        "--results",
        type=Path,
        help="folder for the JSON and runs/ (default: the JSON in results/scaling/results/, runs/ beside it)",
    )
    args = parser.parse_args(argv)
    args.lock = args.lock or None
    results = RESULTS / "results" if args.results is None else args.results
    results.mkdir(exist_ok=True)
    for workers in args.workers:
        result = run_point(args, workers)
        (results / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
        m = result["medians"]
        print(f"{result['name']}: step {m['step_s'] * 1e3:.0f} ms, communicate {m['communicate_s'] * 1e3:.0f} ms, "
              f"sent {result['means']['bytes_sent'] / 1e3:.0f} kB, accuracy {result['final_test_accuracy']:.4f}, "
              f"load {result['load_average_before'][0]:.1f}->{result['load_average_after'][0]:.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
