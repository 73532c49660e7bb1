"""One GPU, under five minutes: does gradsift's hook path run right on CUDA + NCCL, without
waiting on the host?

Run by ``benchmarks/gpu/check.sh`` in parts (``--only``), each its own process under its own
``timeout``. Every check appends one JSON line to ``--jsonl`` the moment it ends (a part that
times out keeps what its earlier checks wrote); one that raises never stops the others. A
check **fails** when it raises or when one of its conditions does not hold, and any failure
makes the exit status 1:

* ``sync_counter``: the counter itself must count a known host read (``.item()``) on the
  main thread *and* in a DDP comm hook, which runs on autograd's device thread.
* ``determinism``: ``W = 4`` sparse payloads with overlapping positions decoded twice on the
  device (``scatter_mean``) and the balanced exchange's slice sum: bit for bit equal to each
  other and to the CPU's rank-order sum (a single ``index_add_`` of all payloads, the old
  decode, is reported beside it).
* ``selection``: one heavy-tailed bucket where far more than twice the capacity pass the
  threshold: the device's fixed-capacity selection equals the CPU's (fp32, bf16), and so do
  random-k's draws and VGC's payload.
* ``exchanges``: a world-size-1 NCCL group; for every compressor x exchange the registry
  allows (SIDCo also on its statistical path), a DDP model trains a few steps under
  ``torch.cuda.set_sync_debug_mode("warn")``, counting the synchronising calls per step
  (budget: :data:`BUDGET`, :data:`BALANCED_BUDGET` for the balanced exchange; stock DDP's count
  beside them) and during backward alone (budget 0: the step closes on the device and settles
  at the optimizer's step); ``topk`` at ratio 1 must give stock DDP's parameters exactly.
* ``bf16_layer``: a bf16 model at ``granularity="layer"``, the same budget.
* ``memory``: ``torch.cuda.max_memory_allocated`` after each of 12 steps of ``sidco-exp`` and
  ``vgc``: the peak must not grow after the fourth step.
* ``static_graph``: DDP(static_graph=True) with the hook completes its steps.
* ``amp``: autocast fp16 + ``GradScaler`` + SGD with weight decay, ``topk`` at ratio 1 with
  ``optimizer=`` and ``scaler=``, against stock DDP: relative parameter difference at most
  :data:`AMP_TARGET`.
* ``encode`` (a measurement): the hook's sync-free encode (``HookEncoder``: ``encode`` with
  the hook's capacity and a step readout, each step closed untimed) of ``sidco-exp`` (as the
  hook runs it, and on its statistical path) and ``topk`` against ``torch.topk(|x|, k)`` at
  2^20, 10^7 and 10^8 elements, ratios 0.01 and 0.001, median time by CUDA events.
* ``step_time`` (a measurement): stock DDP against the hook on an MLP of 4 x Linear(2048, 2048).
* ``two_ranks``: two gloo ranks sharing the device (NCCL refuses two ranks on one GPU): a
  set of pairs trains a few steps and both ranks must hold the same parameters.

``--device cpu`` runs every check on CPU with gloo at toy sizes (how the test suite checks
this script; host reads are then counted with the test suite's counter,
tests/support/host_reads.py, instead of CUDA's sync debug mode). Needs torch 2.3 or later
(``init_process_group(device_id=)``); the GPU image's 2.11 is the one it is meant for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.compressors import draws, kernels, scatter_mean
from gradsift.core.payload import Payload
from gradsift.core.readout import Readout
from gradsift.exchanges import balanced
from gradsift.tools.benchmarking import HookEncoder

# benchmarks/: the shared provenance stamp and worker launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import provenance
from workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
#: Host synchronisations per step the hook may make: the step close's one read, and a spare
#: (the balanced exchange: 4); the budgets of tests/hook/test_host_reads.py, which counts on CPU.
BUDGET = 1
BALANCED_BUDGET = 4
#: The GradScaler run's largest relative parameter difference from stock DDP.
AMP_TARGET = 1e-4
#: SIDCo's statistical path beside its default one (exact top-k below its crossover).
FITTED = ("sidco-exp/fit", "sidco-gpareto/fit", "sidco-gamma/fit")


def pairs() -> list[tuple[str, str]]:
    """Every (compressor, exchange) the registry allows, SIDCo also on its statistical path."""
    names = [*gradsift.available_compressors(), *FITTED]
    return [(name, exchange) for name in names for exchange in build(name).exchanges]


def build(name: str) -> gradsift.Compressor:
    if name in FITTED:
        return gradsift.get_compressor(name.split("/")[0], exact_below=0)
    options = {"threshold": {"threshold": 0.01}, "powersgd": {"start_iter": 2}}.get(name, {})
    return gradsift.get_compressor(name, **options)


def mlp(width: int, depth: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(device, dtype)


class SyncCounter:
    """Counts the host synchronisations in a block: CUDA's sync debug warnings on a GPU, the
    test suite's host-read counter on CPU (tests/support/host_reads.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count = 0
        self.sites: dict[str, int] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if self.device.type != "cuda":
            sys.path.insert(0, str(ROOT / "tests"))
            from support.host_reads import HostReads

            reads = HostReads()
            with reads:
                yield
            self.count += reads.count
            for site, n in reads.sites.items():
                self.sites[site] = self.sites.get(site, 0) + n
            return
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
                torch.cuda.set_sync_debug_mode(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for warning in caught:
            if "synchroniz" in str(warning.message).lower():
                self.count += 1
                site = f"{Path(warning.filename).name}:{warning.lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1


def train_steps(
    model: DDP,
    steps: int,
    device: torch.device,
    width: int,
    counter: SyncCounter | None = None,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    backward: SyncCounter | None = None,
) -> None:
    """``steps`` SGD steps; ``counter`` counts the syncs of each whole step, ``backward`` those
    of its backward alone."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, width, generator=generator).to(device, dtype)
        y = torch.randn(16, 8, generator=generator).to(device, dtype)
        context = counter.counting() if counter is not None else contextlib.nullcontext()
        in_backward = backward.counting() if backward is not None else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            with in_backward:
                loss.backward()
            optimizer.step()


def syncs_per_step(
    name: str,
    exchange: str,
    device: torch.device,
    width: int,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    granularity: str = "bucket",
) -> dict[str, Any]:
    """Train a few steps (DDP rebuilds its buckets, PowerSGD starts), then count two."""
    model = DDP(mlp(width, 2, device, dtype), bucket_cap_mb=0.05 if device.type == "cpu" else 1)
    if name != "stock":
        gradsift.register_comm_hook(model, build(name), exchange=exchange, granularity=granularity)
    train_steps(model, 3, device, width, seed=seed, dtype=dtype)
    counter, backward = SyncCounter(device), SyncCounter(device)
    train_steps(model, 2, device, width, counter, seed=seed, dtype=dtype, backward=backward)
    return {
        "syncs_per_step": counter.count / 2,
        "syncs_in_backward": backward.count / 2,
        "sites": counter.sites,
        "model": model,
    }


def equals_stock(device: torch.device, width: int, seed: int = 1) -> bool:
    """``topk`` at ratio 1 through the hook gives stock DDP's parameters, bit for bit."""
    stock = DDP(mlp(width, 2, device))
    hooked = DDP(mlp(width, 2, device))
    gradsift.register_comm_hook(hooked, "topk", ratio=1.0)
    train_steps(stock, 3, device, width, seed=seed)
    train_steps(hooked, 3, device, width, seed=seed)
    return all(torch.equal(a, b) for a, b in zip(stock.parameters(), hooked.parameters(), strict=True))


def check_sync_counter(device: torch.device, small: bool) -> dict[str, Any]:
    """The counter counts a known ``.item()`` on the main thread and in a comm hook, which DDP
    runs on autograd's device thread (where every hook of gradsift runs)."""
    counter = SyncCounter(device)
    with counter.counting():
        torch.ones(3, device=device).sum().item()
    width = 64 if small else 512
    model = DDP(mlp(width, 1, device))

    def reading_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        bucket.buffer().sum().item()  # a host read on autograd's thread
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, reading_hook)
    train_steps(model, 1, device, width)
    in_hook = SyncCounter(device)
    train_steps(model, 2, device, width, in_hook)
    failures = []
    if counter.count < 1:
        failures.append("the counter missed an .item() on the main thread: the counts below mean nothing")
    if in_hook.count < 2:
        failures.append("the counter missed an .item() in a comm hook (autograd's thread)")
    return {"syncs_of_one_item": counter.count, "syncs_of_a_reading_hook_in_2_steps": in_hook.count,
            "failures": failures}  # fmt: skip


def _overlapping(world: int, numel: int, device: torch.device) -> list[Payload]:
    """``world`` payloads of ``numel // 100`` distinct positions among the first ``numel // 50``."""
    payloads = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(rank)
        count = numel // 100
        positions = torch.randperm(numel // 50, generator=generator)[:count].sort().values
        values = torch.randn(count, generator=generator) * 10.0 ** torch.randint(
            -3, 3, (count,), generator=generator
        )
        payloads.append(Payload(numel=numel, dtype=torch.float32, values=values.to(device),
                                indices=positions.to(device)))  # fmt: skip
    return payloads


def check_determinism(device: torch.device, small: bool) -> dict[str, Any]:
    """Sparse means in rank order: the same bits twice on the device and as on the CPU."""
    numel, world = (1 << 14) if small else (1 << 22), 4
    on_device = _overlapping(world, numel, device)
    on_cpu = _overlapping(world, numel, torch.device("cpu"))
    first, second = scatter_mean(on_device, numel), scatter_mean(on_device, numel)
    reference = scatter_mean(on_cpu, numel)
    joined = [torch.zeros(numel, device=device).index_add_(
        0, torch.cat([p.indices for p in on_device]), torch.cat([p.values for p in on_device]) / world
    ) for _ in range(2)]  # fmt: skip
    room = numel // 100
    blocks = balanced._Blocks(
        torch.zeros(world, dtype=torch.bool, device=device),
        torch.full((world,), room, device=device),
        torch.stack([p.indices for p in on_device]),
        torch.stack([p.values for p in on_device]),
    )
    slices = [balanced._reduce_slice(blocks, room, numel, torch.float32) for _ in range(2)]
    failures = []
    if not torch.equal(first, second):
        failures.append("scatter_mean gave other bits the second time")
    if not torch.equal(first.cpu(), reference):
        failures.append("scatter_mean on the device differs from the CPU's rank-order sum")
    if not (
        torch.equal(slices[0].values, slices[1].values) and torch.equal(slices[0].indices, slices[1].indices)
    ):
        failures.append("the balanced slice sum gave other bits the second time")
    return {"numel": numel, "world": world,
            "one_index_add_of_all_payloads_repeats_its_bits": bool(torch.equal(joined[0], joined[1])),
            "failures": failures}  # fmt: skip


def check_selection(device: torch.device, small: bool) -> dict[str, Any]:
    """The device's fixed-capacity selection equals the CPU's on one bucket (> 2x capacity pass)."""
    numel = (1 << 14) if small else (1 << 22)
    generator = torch.Generator().manual_seed(5)
    bucket = torch.empty(numel).exponential_(generator=generator) * torch.randn(numel, generator=generator)
    capacity = numel // 1000
    failures, out = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        x = bucket.to(dtype)
        eta = float(x.float().abs().median())
        cpu = kernels.select_above(x, eta, capacity)
        gpu = kernels.select_above(x.to(device), eta, capacity)
        if device.type == "cpu":  # the dry run: the device branch on CPU tensors
            with kernels.device_branch():
                gpu = kernels.select_above(x, eta, capacity)
        same = torch.equal(cpu.indices, gpu.indices.cpu()) and int(cpu.length) == int(gpu.length)
        out[str(dtype)] = {"selected": int(cpu.selected), "capacity": capacity, "same": same}
        if not same:
            failures.append(f"{dtype}: the device selects other elements than the CPU")
    key = draws.stream_seed(0, "bucket", 7)
    same_draws = torch.equal(draws.below(numel, key, 4096, torch.device("cpu")),
                             draws.below(numel, key, 4096, device).cpu())  # fmt: skip
    if not same_draws:
        failures.append("random-k's draws differ between the CPU and the device")
    payloads = []
    for where, forced in ((torch.device("cpu"), False), (device, device.type == "cpu")):
        vgc = gradsift.get_compressor("vgc", alpha=1.0)
        x = bucket.to(where)
        with kernels.device_branch() if forced else contextlib.nullcontext():
            payloads.append(vgc.encode(x, key=0, capacity=vgc.capacity(numel), readout=Readout(),
                                       variance=(x * x) * 0.01))  # fmt: skip
    same_vgc = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(payloads[0].fields().values(),
                                                                  payloads[1].fields().values(), strict=True))  # fmt: skip
    if not same_vgc:
        failures.append("VGC's payload differs between the CPU and the device")
    return {**out, "same_draws": same_draws, "same_vgc_payload": same_vgc, "failures": failures}


def check_exchanges(device: torch.device, small: bool) -> dict[str, Any]:
    width = 64 if small else 512
    out: dict[str, Any] = {"stock": syncs_per_step("stock", "", device, width)}
    failures = []
    for name, exchange in pairs():
        entry = syncs_per_step(name, exchange, device, width)
        budget = BALANCED_BUDGET if exchange == "balanced" else BUDGET
        if entry["syncs_per_step"] > budget:
            failures.append(
                f"{name} {exchange}: {entry['syncs_per_step']:g} syncs per step (budget {budget})"
            )
        if entry["syncs_in_backward"] > 0:
            failures.append(
                f"{name} {exchange}: {entry['syncs_in_backward']:g} syncs per backward (budget 0)"
            )
        out[f"{name} {exchange}"] = entry
    for entry in out.values():
        del entry["model"]
    same = equals_stock(device, width)
    if not same:
        failures.append("topk at ratio 1 differs from stock DDP")
    return {"pairs": out, "topk ratio 1 equals stock DDP": same, "failures": failures}


#: The pairs the two gloo ranks train (one per exchange and kind of selection: gloo stages
#: CUDA tensors through the host, so every pair costs seconds).
TWO_RANK_PAIRS = [("topk", "allgather"), ("sidco-exp/fit", "allgather"), ("gaussiank", "balanced"),
                  ("dgc", "shared-mask"), ("randomk", "allreduce"), ("vgc", "allgather"), ("fp16", "allreduce")]  # fmt: skip


def two_ranks(rank: int, store: str, device_type: str, results: Any) -> None:
    """One of two gloo ranks on the same device: every pair, then ``topk`` at ratio 1."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    width = 64 if device.type == "cpu" else 512
    out: dict[str, Any] = {}
    failures = []
    for name, exchange in [("stock", ""), *TWO_RANK_PAIRS]:
        entry = syncs_per_step(name, exchange, device, width, seed=1 + rank)
        flat = torch.cat([p.detach().reshape(-1) for p in entry.pop("model").parameters()])
        copies = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(copies, flat)
        if not torch.equal(copies[0], copies[1]):
            failures.append(f"{name} {exchange}: the two ranks' parameters differ")
        out[f"{name} {exchange}".strip()] = entry
    same = equals_stock(device, width, seed=1 + rank)
    if not same:
        failures.append("topk at ratio 1 differs from stock DDP on 2 ranks")
    if rank == 0:
        results.put({"pairs": out, "topk ratio 1 equals stock DDP": same, "failures": failures})
    dist.barrier()  # leave together: a rank that tears gloo down early aborts its peer
    dist.destroy_process_group()


def check_two_ranks(device: torch.device, small: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(two_ranks, (f"{tmp}/store", device.type), 2, timeout_s=35)


def check_static_graph(device: torch.device, small: bool) -> dict[str, Any]:
    width = 64 if small else 512
    out = {}
    for name in ("sidco-exp", "fp16", "powersgd"):
        model = DDP(mlp(width, 2, device), static_graph=True)
        gradsift.register_comm_hook(model, build(name))
        started = time.perf_counter()
        train_steps(model, 4, device, width)
        out[name] = {"steps": 4, "seconds": time.perf_counter() - started}
    return out


def check_bf16_layer(device: torch.device, small: bool) -> dict[str, Any]:
    """A bf16 model at ``granularity="layer"``: the sync budget holds."""
    width = 64 if small else 512
    out, failures = {}, []
    for name, exchange in (("topk", "allgather"), ("sidco-exp/fit", "allgather"), ("vgc", "allgather"),
                           ("gaussiank", "balanced"), ("randomk", "allreduce")):  # fmt: skip
        entry = syncs_per_step(name, exchange, device, width, dtype=torch.bfloat16, granularity="layer")
        del entry["model"]
        budget = BALANCED_BUDGET if exchange == "balanced" else BUDGET
        if entry["syncs_per_step"] > budget or entry["syncs_in_backward"] > 0:
            failures.append(
                f"{name} {exchange} bf16 layer: {entry['syncs_per_step']:g} syncs per step, "
                f"{entry['syncs_in_backward']:g} in backward"
            )
        out[f"{name} {exchange}"] = entry
    return {"pairs": out, "failures": failures}


def check_memory(device: torch.device, small: bool) -> dict[str, Any]:
    """``max_memory_allocated`` after each step: no growth once the state exists."""
    if device.type != "cuda":
        return {"skipped": "no CUDA memory statistics on CPU"}
    width, out, failures = 1024, {}, []
    for name in ("sidco-exp", "vgc"):
        model = DDP(mlp(width, 2, device))
        gradsift.register_comm_hook(model, name)
        peaks = []
        for _ in range(12):
            train_steps(model, 1, device, width)
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device))
        out[name] = peaks
        if peaks[-1] > peaks[3] + (1 << 20):
            failures.append(f"{name}: peak memory grew from {peaks[3]} to {peaks[-1]} bytes after step 4")
        del model
    return {"peaks_bytes": out, "failures": failures}


def check_evaluate(device: torch.device, small: bool) -> dict[str, Any]:
    from gradsift.tools.train.data import synthetic_split
    from gradsift.tools.train.loop import evaluate
    from gradsift.tools.train.models import build_model

    test = synthetic_split(200 if small else 2000, seed=1)
    model = build_model("mlp", 0).to(device)
    accuracy, loss = evaluate(model, test, device)
    return {"accuracy": accuracy, "loss": loss}


def check_amp(device: torch.device, small: bool) -> dict[str, Any]:
    width = 64 if small else 512
    autocast = torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16)
    results = {}
    for label in ("stock", "hook"):
        model = DDP(mlp(width, 2, device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.05)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)
        if label == "hook":
            gradsift.register_comm_hook(
                model, "topk", ratio=1.0, momentum_masking=False, optimizer=optimizer, scaler=scaler
            )
        generator = torch.Generator(device="cpu").manual_seed(3)
        for _ in range(10):
            x = torch.randn(16, width, generator=generator).to(device)
            y = torch.randn(16, 8, generator=generator).to(device)
            optimizer.zero_grad()
            with autocast:
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        results[label] = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    difference = float((results["hook"] - results["stock"]).norm() / results["stock"].norm())
    failures = [] if difference <= AMP_TARGET else [f"relative difference {difference:.3g} > {AMP_TARGET:g}"]
    return {"relative_difference": difference, "target": AMP_TARGET, "failures": failures}


def timed(
    function: Callable[[], Any], device: torch.device, repeats: int, after: Callable[[], Any] = lambda: None
) -> float:
    """Median milliseconds of ``function`` (CUDA events on a GPU), after two warm-up calls;
    ``after`` runs untimed after each call (the step's close of a hook encode)."""
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            function()
            times.append((time.perf_counter() - started) * 1e3)
        after()
    return statistics.median(times[2:])


def check_encode(device: torch.device, small: bool) -> dict[str, Any]:
    sizes = [1 << 12, 10_000] if small else [1 << 20, 10**7, 10**8]
    repeats = 2 if small else 5
    rows = []
    for numel in sizes:
        x = torch.randn(numel, device=device)
        for ratio in (0.01, 0.001):
            k = max(1, int(numel * ratio))
            times = {
                "torch.topk": timed(lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False), device, repeats)
            }
            for label, compressor in (
                ("topk", gradsift.get_compressor("topk", ratio=ratio)),
                ("sidco-exp", gradsift.get_compressor("sidco-exp", ratio=ratio)),
                ("sidco-exp fit", gradsift.get_compressor("sidco-exp", ratio=ratio, exact_below=0)),
            ):
                # what the DDP hook calls (no host read), each step closed untimed as the hook's close
                encoder = HookEncoder(compressor)
                times[label] = timed(lambda e=encoder, x=x: e.encode(x), device, repeats, after=encoder.close)
            for label, ms in times.items():
                rows.append({"numel": numel, "ratio": ratio, "method": label, "encode_ms": ms,
                             "speedup_vs_torch_topk": times["torch.topk"] / ms})  # fmt: skip
        del x
    return {"rows": rows}


def check_step_time(device: torch.device, small: bool) -> dict[str, Any]:
    width, depth = (64, 2) if small else (2048, 4)
    repeats = 3 if small else 10
    out = {}
    generator = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(64, width, generator=generator).to(device)
    y = torch.randn(64, 8, generator=generator).to(device)
    for label, name in (
        ("stock", None),
        ("none", "none"),
        ("topk@0.01", "topk"),
        ("sidco-exp@0.01", "sidco-exp"),
    ):
        model = DDP(mlp(width, depth, device))
        if name is not None:
            gradsift.register_comm_hook(model, name, **({} if name == "none" else {"ratio": 0.01}))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)

        def step(model: DDP = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

        for _ in range(3):
            step()
        out[label] = timed(step, device, repeats)
    out["ratios"] = {label: ms / out["stock"] for label, ms in out.items() if label != "stock"}
    return out


CHECKS = {
    "sync_counter": check_sync_counter,
    "determinism": check_determinism,
    "selection": check_selection,
    "exchanges": check_exchanges,
    "bf16_layer": check_bf16_layer,
    "memory": check_memory,
    "static_graph": check_static_graph,
    "amp": check_amp,
    "evaluate": check_evaluate,
    "encode": check_encode,
    "step_time": check_step_time,
    "two_ranks": check_two_ranks,
}


def environment(device: torch.device) -> dict[str, Any]:
    """torch, CUDA and NCCL versions and the device (printed first: a failed run still says where it ran)."""
    cuda = device.type == "cuda"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpus": torch.cuda.device_count() if cuda else 0}  # fmt: skip


def append(path: Path, line: dict[str, Any]) -> None:
    """One JSON line, appended and flushed to disk at once (a later timeout loses nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: toy sizes, gloo")
    parser.add_argument("--jsonl", type=Path, required=True, help="JSON lines appended after every check")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    parser.add_argument("--stamp", action="store_true", help="also append the machine's provenance stamp")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"check.py: no CUDA GPU visible to torch {torch.__version__}", file=sys.stderr)
        append(args.jsonl, {"check": "environment", "ok": False, "error": "no CUDA GPU visible"})
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    small = device.type == "cpu"
    stamp = provenance.start() if args.stamp else None
    env = environment(device)
    print(" ".join(f"{key} {value}" for key, value in env.items()), flush=True)
    if args.stamp:
        append(args.jsonl, {"check": "environment", "ok": True, "result": env})
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        for name in args.only or list(CHECKS):
            started = time.perf_counter()
            try:
                result = CHECKS[name](device, small)
                entry = {"check": name, "ok": not result.get("failures"), "result": result}
            except Exception:  # one check's failure must not hide the others' results
                entry = {"check": name, "ok": False, "error": traceback.format_exc(limit=8)}
            entry["seconds"] = round(time.perf_counter() - started, 2)
            append(args.jsonl, entry)
            ok &= entry["ok"]
            print(f"{name:<14} {'ok' if entry['ok'] else 'FAILED'} {entry['seconds']:7.1f} s", flush=True)
            report(entry)
        dist.destroy_process_group()
    if stamp is not None:
        append(args.jsonl, {"check": "machine", "ok": True, "result": stamp.finish()})
    return 0 if ok else 1


def report(entry: dict[str, Any]) -> None:
    """A few lines of one check's result, and what failed."""
    name, result = entry["check"], entry.get("result", {})
    if name in ("exchanges", "two_ranks", "bf16_layer"):
        worst = sorted(result.get("pairs", {}).items(), key=lambda item: -item[1]["syncs_per_step"])
        print("  most host synchronisations per step: "
              + ", ".join(f"{pair} {item['syncs_per_step']:g}" for pair, item in worst[:6]))  # fmt: skip
    if name == "encode":
        for row in result.get("rows", []):
            print(f"  n={row['numel']:>11,} ratio={row['ratio']:<6} {row['method']:<14} {row['encode_ms']:9.3f}"
                  f"  x{row['speedup_vs_torch_topk']:.2f}")  # fmt: skip
    if name in ("step_time", "determinism", "selection", "memory", "sync_counter"):
        print(f"  {json.dumps(result, default=str)[:300]}")
    for failure in result.get("failures", []):
        print(f"FAILED {name}: {failure}")
    if "error" in entry:
        print(f"FAILED {name}: {entry['error'].strip().splitlines()[-1]}")


if __name__ == "__main__":
    sys.exit(main())
