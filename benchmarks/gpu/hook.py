"""Two-process DDP step time with the gradsift hook on CUDA tensors (part of run.sh).

Backend: NCCL when the machine has two or more GPUs (rank r on GPU r), otherwise gloo
with both ranks' CUDA tensors on GPU 0 (NCCL refuses two ranks on one GPU; gloo
stages CUDA tensors through host memory, so the communication time is gloo's, while
the compression is measured on the GPU either way). ``--device cpu`` runs the same
code on CPU tensors over gloo, which is how the test suite checks this script.

Every configuration gets its own DDP model with the same weights; step ``s`` of every
configuration runs before step ``s + 1`` of any, each step timed with
``torch.cuda.synchronize()`` on both sides. Writes the median step time, its ratio
to stock DDP and the hook's per-step telemetry medians (compress/communicate/
decompress ms, bytes) as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsift

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance
from workers import run_ranks

CONFIGURATIONS = {
    "stock": None,
    "none": ("none", {}),
    "topk@0.01": ("topk", {"ratio": 0.01}),
    "sidco-exp@0.01": ("sidco-exp", {"ratio": 0.01}),
}
TELEMETRY = ("compress_ms", "communicate_ms", "decompress_ms", "bytes_sent", "density")


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def rank_device(rank: int, device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"


def run_rank(rank: int, world: int, store: str, args: argparse.Namespace, results: Any) -> None:
    device = rank_device(rank, args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the CPU check: two ranks, one thread each
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(
        backend_for(args.device), init_method=f"file://{store}", rank=rank, world_size=world
    )
    runs = {}
    for label, configuration in CONFIGURATIONS.items():
        model = DistributedDataParallel(
            mlp(args.width, args.depth).to(device),
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        state = (
            None
            if configuration is None
            else gradsift.register_comm_hook(model, configuration[0], **configuration[1])
        )
        runs[label] = (model, torch.optim.SGD(model.parameters(), lr=0.01), state, [], [])
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.warmup + args.steps):
        inputs = torch.randn(args.batch, args.width, generator=generator).to(device)
        labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
        for model, optimizer, state, times, telemetry in runs.values():
            dist.barrier()
            sync()
            started = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            sync()
            if step >= args.warmup:
                times.append((time.perf_counter() - started) * 1e3)
                if state is not None:
                    telemetry.append(state.stats()["step"])
    if rank == 0:
        report = {}
        for label, (_, _, _, times, telemetry) in runs.items():
            entry = {"median_step_ms": statistics.median(times), "step_ms": times}
            for key in TELEMETRY if telemetry else ():
                entry[key] = statistics.median(step[key] for step in telemetry)
            report[label] = entry
        for entry in report.values():
            entry["ratio_to_stock"] = entry["median_step_ms"] / report["stock"]["median_step_ms"]
        results.put(report)
    dist.barrier()  # leave together: a rank that tears gloo down early aborts its peer
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--width", type=int, default=4096, help="MLP width (default 4096: 4 layers ~ 67M parameters)"
    )
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1 (the medians need a timed step)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (use --device cpu to check the script)")
    stamp = provenance.start(seeds=[0, 1])  # the model's seed and each rank's batches
    with tempfile.TemporaryDirectory() as folder:  # the ranks meet through a file store: no port to pick
        report = run_ranks(run_rank, (2, f"{folder}/store", args), 2, timeout_s=1800)
    parameters = sum(p.numel() for p in mlp(args.width, args.depth).parameters())
    facts = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "backend": backend_for(args.device),
        "model": f"MLP {args.depth}x Linear({args.width},{args.width}) + Linear({args.width},10), "
        f"{parameters} parameters, batch {args.batch} per rank",
        "args": {**vars(args), "json": str(args.json)},
        "provenance": stamp.finish(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**facts, "results": report}, indent=2) + "\n")
    for label, entry in report.items():
        print(f"{label:16s} step {entry['median_step_ms']:9.2f} ms  x stock {entry['ratio_to_stock']:.2f}"
              + (f"  compress {entry['compress_ms']:.2f} ms" if "compress_ms" in entry else ""))  # fmt: skip


if __name__ == "__main__":
    main()
