"""What turning a summed bucket into its mean costs a comm hook on gloo, and the one way around it.

Two gloo ranks on localhost (one thread each) time, interleaved round by round on the
same float32 bucket of ``--numel`` elements (default 2 099 200: the larger bucket of
``hook_overhead/run.py``'s MLP):

* ``allreduce`` -- ``all_reduce`` of the bucket: the sum, what stock DDP runs after it
  multiplied each gradient by ``1/W`` while copying it into the bucket;
* ``mean-then-allreduce`` -- ``mul_(1/W)`` of the bucket, then ``all_reduce``: what a comm
  hook runs (gradsift's stock step); the difference to ``allreduce`` is the extra pass;
* ``reduce-scatter-mean-allgather`` -- ``reduce_scatter_tensor``, ``mul_(1/W)`` of the
  rank's ``1/W`` shard, ``all_gather_into_tensor``: the mean on a ``1/W`` share of the
  bucket, the only way to shrink that pass, at the price of two collectives.

Medians over ``--rounds`` rounds (after ``--warmup``), rank 0's clock, a barrier before
each timing. Then both mean ways run once on rank-dependent buckets and must deliver
their closed-form mean (the run fails otherwise).

    python benchmarks/hook_overhead/mean_pass.py --json results/hook_overhead/mean_pass.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance
from workers import run_ranks

WORLD = 2
WAYS = ("allreduce", "mean-then-allreduce", "reduce-scatter-mean-allgather")


def _run(way: str, bucket: torch.Tensor, shard: torch.Tensor, world: int) -> None:
    if way == "allreduce":
        dist.all_reduce(bucket)
    elif way == "mean-then-allreduce":
        bucket.mul_(1.0 / world)
        dist.all_reduce(bucket)
    else:
        dist.reduce_scatter_tensor(shard, bucket)
        shard.mul_(1.0 / world)
        dist.all_gather_into_tensor(bucket, shard)


def worker(rank: int, world: int, store_path: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    generator = torch.Generator().manual_seed(rank)
    bucket = torch.empty(args.numel)
    shard = torch.empty(args.numel // world)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(args.warmup + args.rounds):
        for way in WAYS:
            bucket.normal_(generator=generator)  # fresh values: no subnormals from repeated halving
            dist.barrier()
            started = time.perf_counter()
            _run(way, bucket, shard, world)
            if round_ >= args.warmup:
                times[way].append((time.perf_counter() - started) * 1e3)
    # the two mean ways against the closed-form mean of rank-dependent buckets (rank r holds (r + 1) x)
    ramp = torch.arange(args.numel, dtype=torch.float32) % 1024
    expected = ramp * (sum(r + 1 for r in range(world)) / world)
    for way in WAYS[1:]:
        bucket.copy_(ramp * (rank + 1))
        _run(way, bucket, shard, world)
        if not torch.allclose(bucket, expected, rtol=1e-6, atol=0.0):
            raise RuntimeError(f"{way} did not deliver the mean over the ranks")
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_099_200, help="float32 elements of the bucket")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.numel < WORLD or args.numel % WORLD or args.rounds < 1 or args.warmup < 0:
        parser.error(
            f"--numel must be a positive multiple of {WORLD}, --rounds at least 1, --warmup at least 0"
        )
    stamp = provenance.start(seeds=[0, 1])  # each rank's values
    with tempfile.TemporaryDirectory() as tmp:
        times = run_ranks(worker, (WORLD, os.path.join(tmp, "store"), args), WORLD, timeout_s=600)
    plain = statistics.median(times["allreduce"])
    results = {}
    for way in WAYS:
        median = statistics.median(times[way])
        results[way] = {"median_ms": median, "ratio_to_allreduce": median / plain, "ms": times[way]}
        print(f"{way:>30}: {median:7.2f} ms  {median / plain:5.2f}x all_reduce", flush=True)
    stamp.write(args.json, args, world_size=WORLD, threads_per_rank=1, results=results)


if __name__ == "__main__":
    main()
