"""What fixing glibc's mmap threshold costs a step, and what it saves of the peak RSS.

docs/memory.md's allocator note: with ``MALLOC_MMAP_THRESHOLD_=131072`` in a process's
environment glibc stops raising its mmap threshold to each large block it frees, so a
bucket-sized tensor is mapped and unmapped on its own instead of leaving resident holes in
the heap -- at the price of a ``mmap``, its page faults and a ``munmap`` for every such
tensor. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` beside it glibc also advises each
mapped block for transparent huge pages, so the kernel faults it in 2 MiB pages (512 times
fewer faults for the same bytes, each page still zeroed). This runs ``peak.py``'s model (two
gloo ranks, SGD with momentum 0.9) under stock DDP, ``topk`` and ``sidco-exp`` (ratio 0.01),
each arm in two fresh spawned processes, under each of :data:`SETTINGS` in turn (the order
reversed every other round), ``--rounds`` times, so a drift of the machine's speed reaches
every setting. Per run: each rank's median step time over the steps after ``--skip`` (DDP's
bucket rebuild and the first compressed steps), the larger rank's reported, and each rank's
peak RSS minus its RSS before DDP was built, the larger rank's, less stock DDP's in the same
round and setting. Per arm and setting, the step time over glibc's defaults', paired by round,
as a mean with its 95 % t-interval. Usage (a clean checkout of a commit on main; five rounds
take about ten minutes)::

    flock /tmp/gradsift-cpu.lock python benchmarks/memory/threshold_cost.py --rounds 5 --json results/memory/threshold-cost.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths, workers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "auto"))  # one_line: the paired interval
import peak
import provenance
from intervals import bounds
from paths import results_dir
from workers import run_ranks

#: glibc's environment per setting: its defaults, the threshold fixed, and the threshold fixed with
#: each mapped block advised for transparent huge pages (glibc 2.35 on; the kernel's
#: ``transparent_hugepage/enabled`` must be ``madvise`` or ``always``), so that a bucket-sized
#: tensor faults in 2 MiB pages instead of 4 KiB ones.
SETTINGS = {
    "glibc defaults": {},
    "threshold fixed": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "threshold fixed, huge pages": {
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    },
}
DEFAULTS = "glibc defaults"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ARMS = ("stock", "topk", "sidco-exp")
OPTIMIZER = "sgd"


def worker(rank: int, store_path: str, label: str, steps: int, skip: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=peak.WORLD, store=dist.FileStore(store_path, peak.WORLD)
    )
    module = peak.make_model()
    start = peak.rss_now()
    arm = next(a for a in peak.ARMS if a.label == label)
    model, optimizer, _ = peak.build(arm, OPTIMIZER, module)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randn(peak.BATCH, peak.WIDTH, generator=generator)
        y = torch.randint(0, 10, (peak.BATCH,), generator=generator)
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    mine = {"step_ms": 1e3 * statistics.median(times[skip:]), "extra_rss": peak.rss_peak() - start}
    ranks: list[Any] = [None] * peak.WORLD
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        queue.put(ranks)
    dist.barrier()
    dist.destroy_process_group()


def run(label: str, setting: str, steps: int, skip: int) -> list[dict[str, float]]:
    """Each rank's median step and peak RSS growth, ``label``'s arm in fresh processes whose
    environment carries ``setting``'s variables (read by glibc as the process starts)."""
    saved = dict(os.environ)
    os.environ.update(SETTINGS[setting])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = (os.path.join(tmp, "store"), label, steps, skip)
            return run_ranks(worker, args, peak.WORLD, timeout_s=600)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def summarise(runs: list[dict[str, Any]], parameter_bytes: int) -> dict[str, Any]:
    """Per arm and setting the median over rounds of the step and of the RSS over stock DDP (in
    the parameters' bytes); per arm and setting other than glibc's defaults its step over the
    defaults', paired by round (mean and 95 % t-interval)."""
    by = {(r["round"], r["arm"], r["setting"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    arms: dict[str, Any] = {}
    for arm in ARMS:
        row: dict[str, Any] = {}
        for setting in SETTINGS:
            mine = [by[(n, arm, setting)] for n in rounds]
            row[setting] = {
                "step_ms": statistics.median(r["step_ms"] for r in mine),
                "extra_rss_over_parameter_bytes": statistics.median(
                    (r["extra_rss"] - by[(r["round"], "stock", setting)]["extra_rss"]) / parameter_bytes
                    for r in mine
                ),
            }
        row["step_over_defaults"] = {}
        for setting in SETTINGS:
            if setting != DEFAULTS:
                ratios = [
                    by[(n, arm, setting)]["step_ms"] / by[(n, arm, DEFAULTS)]["step_ms"] for n in rounds
                ]
                mean, low, high = bounds(ratios)
                row["step_over_defaults"][setting] = {
                    "mean": mean,
                    "low": low,
                    "high": high,
                    "per_round": ratios,
                }
        arms[arm] = row
    return arms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of the settings (default: 3)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default: 40)")
    parser.add_argument(
        "--skip", type=int, default=10, help="first steps left out of the median (default: 10)"
    )
    parser.add_argument("--json", type=Path, default=results_dir(__file__) / "threshold-cost.json")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.skip >= args.steps:
        parser.error("--rounds must be at least 2 (a paired interval) and --skip below --steps")
    stamp = provenance.start(seeds=sorted({0, *range(peak.WORLD)}))
    parameter_bytes = peak.FP32 * sum(p.numel() for p in peak.make_model().parameters())
    runs: list[dict[str, Any]] = []
    for n in range(args.rounds):
        for setting in SETTINGS if n % 2 == 0 else reversed(SETTINGS):
            for arm in ARMS:
                ranks = run(arm, setting, args.steps, args.skip)
                runs.append({"round": n, "setting": setting, "arm": arm, "ranks": ranks,
                             "step_ms": max(r["step_ms"] for r in ranks),
                             "extra_rss": max(r["extra_rss"] for r in ranks)})  # fmt: skip
                print(f"round {n} {setting:>15} {arm:>9}: step {runs[-1]['step_ms']:6.1f} ms, "
                      f"RSS +{runs[-1]['extra_rss'] / 2**20:6.1f} MiB", flush=True)  # fmt: skip
    stamp.write(
        args.json,
        args,
        model=f"MLP {peak.DEPTH} x Linear({peak.WIDTH}, {peak.WIDTH}) + Linear({peak.WIDTH}, 10), "
        f"batch {peak.BATCH} per rank, SGD momentum 0.9, {peak.WORLD} gloo ranks, one thread each",
        parameter_bytes=parameter_bytes,
        settings=SETTINGS,
        transparent_hugepage=THP_MODE.read_text().strip() if THP_MODE.is_file() else None,
        measured="per rank: the median of each step's wall time (zero_grad, forward, backward, "
        "optimizer step) after --skip steps, and ru_maxrss minus the RSS before DDP; the larger rank's",
        runs=runs,
        arms=summarise(runs, parameter_bytes),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
