"""Step time and bytes of the gradsift DDP hook vs stock DDP, on localhost gloo.

Every configuration gets its own DDP model (same initial weights); the timed steps
are interleaved (step s of every configuration, then step s+1, ...), so background
load hits all of them alike. Reports per configuration the median step time (forward +
backward + hook + optimizer), its ratio to stock DDP, and the hook's telemetry.

    python benchmarks/ddp/bench_hook.py --world-sizes 2 4 --steps 12 --out results/ddp/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir
from workers import run_ranks

CONFIGS = [
    ("stock", None, {}),
    ("none", "none", {}),
    ("bf16", "bf16", {}),
    ("topk@0.01", "topk", {"ratio": 0.01}),
    ("topk@0.001", "topk", {"ratio": 0.001}),
    ("dgc@0.01", "dgc", {"ratio": 0.01}),
    ("dgc@0.001", "dgc", {"ratio": 0.001}),
    ("sidco-exp@0.01", "sidco-exp", {"ratio": 0.01}),
    ("sidco-exp@0.001", "sidco-exp", {"ratio": 0.001}),
]
WIDTH, DEPTH, BATCH = 1024, 3, 32


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def worker(rank: int, world: int, port: int, steps: int, warmup: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    runs = []
    for label, name, options in CONFIGS:
        model = DDP(make_model())
        state = None if name is None else gradsift.register_comm_hook(model, name, **options)
        runs.append((label, model, torch.optim.SGD(model.parameters(), lr=0.01), state, [], []))
    gen = torch.Generator().manual_seed(rank)
    for step in range(warmup + steps):
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
        for _label, model, opt, state, times, stats in runs:
            dist.barrier()
            started = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            elapsed = time.perf_counter() - started
            if step >= warmup:
                times.append(elapsed * 1e3)
                if state is not None:
                    stats.append(state.stats()["step"])
    if rank == 0:
        result = {}
        for label, _model, _opt, _state, times, stats in runs:
            entry = {"median_step_ms": statistics.median(times), "step_ms": times}
            for key in (
                "bytes_sent",
                "bytes_padded",
                "dense_bytes",
                "density",
                "compress_ms",
                "communicate_ms",
                "decompress_ms",
            ):
                if stats:
                    entry[key] = statistics.median(s[key] for s in stats)
            result[label] = entry
        stock = result["stock"]["median_step_ms"]
        for entry in result.values():
            entry["ratio_to_stock"] = entry["median_step_ms"] / stock
        result["_params"] = sum(p.numel() for p in runs[0][1].parameters())
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "results.json")
    args = parser.parse_args()
    stamp = provenance.start(
        seeds=sorted({0, *range(max(args.world_sizes))})
    )  # the model's, each rank's batches
    report = {
        "model": f"MLP {DEPTH}x Linear({WIDTH},{WIDTH}) + Linear({WIDTH},10), batch {BATCH} per rank",
        "results": {},
    }
    for world in args.world_sizes:
        report["results"][str(world)] = run_ranks(
            worker, (world, free_port(), args.steps, args.warmup), world, timeout_s=3000
        )
        print(
            world,
            json.dumps(
                {
                    k: v.get("ratio_to_stock") if isinstance(v, dict) else v
                    for k, v in report["results"][str(world)].items()
                }
            ),
        )
    report["provenance"] = stamp.finish()
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
