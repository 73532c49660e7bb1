"""Step time of the gradsift DDP hook against stock DDP, and where the hook's time goes.

Two gloo ranks on localhost train the 3.16M-parameter MLP of ``benchmarks/ddp``
(3 x Linear(1024, 1024) + Linear(1024, 10), batch 32 per rank, one thread per rank).
Every configuration (stock DDP, PyTorch's two allreduce hooks, and gradsift's hook with
``none``, ``sidco-exp`` and ``topk``) has its own DDP model with the same initial
weights; the timed steps are interleaved
(step s of every configuration, then step s+1, ...) so background load hits all of them
alike, in an order that rotates by one every step (step s starts with configuration
s mod 6), so no configuration always runs right after the same one (the step before
leaves the caches and the allocator in its own state). Each reports the median step
time (zero_grad + forward + backward + hook + SGD step) and its ratio to stock DDP's
median in the same run.

Then every configuration runs ``--profile-steps`` more steps under ``torch.profiler``
(CPU activities, Python stacks) on both ranks; rank 0's profile is summarised per step:
the phases (``forward``, ``backward`` -- which contains the hook and the wait for its
collectives -- and ``optimizer``), the gradsift Python functions by inclusive time, and
the operators by self time. ``backward`` minus stock's ``backward`` is what the hook adds.

    python benchmarks/hook_overhead/run.py --steps 60 --warmup 5 --profile-steps 10 \\
        --json results/hook_overhead/results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import gradsift
from gradsift.tools.benchmarking import in_rotation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance
from workers import run_ranks

#: (label, gradsift compressor, options); ``torch-allreduce-hook`` is PyTorch's own
#: ``default_hooks.allreduce_hook`` (Python) and ``torch-builtin-hook`` its C++ built-in
#: ``BuiltinCommHookType.ALLREDUCE``: the controls for what any comm hook costs over stock
#: DDP (without a hook, DDP divides by the world size while copying gradients into the
#: bucket; a hook receives the bucket undivided and divides it in one more pass).
TORCH_HOOK = "torch-allreduce-hook"
BUILTIN_HOOK = "torch-builtin-hook"
CONFIGS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("stock", None, {}),
    (TORCH_HOOK, None, {}),
    (BUILTIN_HOOK, None, {}),
    ("none", "none", {}),
    ("sidco-exp@0.01", "sidco-exp", {"ratio": 0.01}),
    ("topk@0.01", "topk", {"ratio": 0.01}),
    ("auto", "auto", {}),  # the one line: measures for 10 steps, then runs its choice
]
PHASES = ("forward", "backward", "optimizer")
_BOUND_METHOD = re.compile(r"^<built-in method (\w+) of .*>$")
_BENCH_HOOK = Path(__file__).resolve().parents[1] / "ddp" / "bench_hook.py"


def _ddp_benchmark() -> Any:
    """benchmarks/ddp/bench_hook.py as a module: its model and batch are the ones measured here."""
    spec = importlib.util.spec_from_file_location("bench_hook", _BENCH_HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    with record_function("forward"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()


def _summarise(prof: profile, steps: int, top: int) -> dict[str, Any]:
    """Per-step ms of the phases, of gradsift's Python functions (inclusive) and of the top operators (self)."""
    phases: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.name in PHASES:
            phases[event.name] += event.cpu_time_total / 1e3 / steps
        elif "gradsift" in event.name and ".py(" in event.name:
            name = event.name.split("gradsift/", 1)[-1]
            functions[name] += event.cpu_time_total / 1e3 / steps
            calls[name] += 1
    operators: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for average in prof.key_averages():
        if ".py(" not in average.key and average.key not in PHASES:
            totals = operators[_BOUND_METHOD.sub(r"<built-in method \1>", average.key)]
            totals[0] += average.self_cpu_time_total / 1e3 / steps
            totals[1] += average.count / steps
    return {
        "phases_ms": dict(phases),
        "gradsift_functions_ms": {
            name: {"inclusive_ms": ms, "calls_per_step": calls[name] / steps}
            for name, ms in sorted(functions.items(), key=lambda item: -item[1])[:top]
        },
        "operators_self_ms": {
            name: {"self_ms": ms, "calls_per_step": count}
            for name, (ms, count) in sorted(operators.items(), key=lambda item: -item[1][0])[:top]
        },
    }


def worker(rank: int, world: int, store_path: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    make_model = _ddp_benchmark().make_model
    runs = []
    for label, name, options in CONFIGS:
        model = DDP(make_model())
        state = None if name is None else gradsift.register_comm_hook(model, name, **options)
        if label == TORCH_HOOK:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        if label == BUILTIN_HOOK:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        runs.append((label, model, torch.optim.SGD(model.parameters(), lr=0.01), state))
    times: dict[str, list[float]] = {label: [] for label, *_ in runs}
    telemetry: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in runs}
    gen = torch.Generator().manual_seed(rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(32, 1024, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    for step in range(args.warmup + args.steps):
        x, y = batch()
        for label, model, optimizer, state in in_rotation(runs, step):
            dist.barrier()
            started = time.perf_counter()
            _step(model, optimizer, x, y)
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                times[label].append(elapsed * 1e3)
                if state is not None:
                    telemetry[label].append(state.stats()["step"])
    profiles = {}
    for label, model, optimizer, _state in runs if args.profile_steps else ():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(args.profile_steps):
                _step(model, optimizer, *batch())
        if rank == 0:
            profiles[label] = _summarise(prof, args.profile_steps, args.top)
    if rank == 0:
        queue.put({"times": times, "telemetry": telemetry, "profiles": profiles})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=10, help="profiled steps (0: none)")
    parser.add_argument("--top", type=int, default=25, help="operators and functions kept per profile")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.steps < 1 or args.profile_steps < 0:
        parser.error("--steps must be at least 1 and --profile-steps at least 0 (0: no profile)")
    stamp = provenance.start(seeds=[0, 1])  # the model's seed (bench_hook.make_model) and each rank's batches
    with tempfile.TemporaryDirectory() as tmp:
        measured = run_ranks(worker, (2, os.path.join(tmp, "store"), args), 2, timeout_s=3000)
    stock = statistics.median(measured["times"]["stock"])
    results = {}
    for label, samples in measured["times"].items():
        median = statistics.median(samples)
        entry: dict[str, Any] = {
            "median_step_ms": median,
            "ratio_to_stock": median / stock,
            "step_ms": samples,
        }
        steps = measured["telemetry"][label]
        for key in ("bytes_sent", "density", "compress_ms", "communicate_ms", "decompress_ms"):
            if steps and key in steps[0]:
                entry[f"median_{key}"] = statistics.median(s[key] for s in steps)
        if args.profile_steps:
            entry["profile"] = measured["profiles"][label]
        results[label] = entry
        print(f"{label:>16}: {median:7.2f} ms  {median / stock:5.3f}x stock", flush=True)
    stamp.write(
        args.json,
        args,
        model="MLP 3 x Linear(1024, 1024) + Linear(1024, 10), 3 159 050 parameters, batch 32 per rank",
        world_size=2,
        threads_per_rank=1,
        results=results,
    )


if __name__ == "__main__":
    main()
