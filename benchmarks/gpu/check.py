"""One GPU, a few minutes: does gradsift's hook path run on CUDA + NCCL without waiting on the host?

Run by ``benchmarks/gpu/check.sh`` (which then trains with ``gradsift train`` and runs the
CUDA tests). It prints the environment (torch, CUDA, NCCL), then runs each check on its own;
one that raises never stops the others. A check **fails** when it raises or when one of its
conditions does not hold, and any failure makes the exit status 1:

* ``sync_counter``: the counter itself, on a known host read (``.item()``): it must count it.
* ``exchanges``: a world-size-1 NCCL process group; for every compressor x exchange the
  registry allows (SIDCo also on its statistical path), a DDP model trains a few steps under
  ``torch.cuda.set_sync_debug_mode("warn")``, counting the synchronising calls per step
  (budget: :data:`BUDGET`, :data:`BALANCED_BUDGET` for the balanced exchange; stock DDP's count
  is reported beside them); ``topk`` at ratio 1 must give stock DDP's parameters exactly.
* ``two_ranks``: two gloo ranks sharing the device (NCCL refuses two ranks on one GPU): every
  pair trains a few steps and both ranks must hold the same parameters after it; ``topk`` at
  ratio 1 must equal stock DDP. Syncs are reported, not budgeted (gloo stages CUDA tensors
  through the host, and its copies synchronise).
* ``static_graph``: DDP(static_graph=True) with the hook completes its steps.
* ``evaluate``: the trainer's evaluation on a CUDA model under NCCL.
* ``amp``: autocast fp16 + ``GradScaler`` + SGD with weight decay, ``topk`` at ratio 1 with
  ``optimizer=`` and ``scaler=``, against stock DDP: relative parameter difference at most
  :data:`AMP_TARGET`.
* ``encode`` (a measurement): the hook's sync-free encode (``Compressor.encode`` with the
  hook's capacity and a step readout, each step closed untimed:
  ``gradsift.tools.benchmarking.HookEncoder``; not the public ``compress()``, which reads
  counts on the host) of ``sidco-exp`` (as the hook runs it, and forced onto its
  statistical path) and ``topk`` against a bare ``torch.topk(|x|, k)`` at 2^20, 10^7 and 10^8
  elements and ratios 0.01 and 0.001, median time by CUDA events.
* ``step_time`` (a measurement): stock DDP against the hook (``none``, ``topk``,
  ``sidco-exp`` at 0.01) on an MLP of 4 x Linear(2048, 2048), median of 20 steps.

``--device cpu`` runs every check on CPU with gloo at toy sizes (how the test suite checks
this script; host reads are then counted with the test suite's counter, tests/support/host_reads.py,
instead of CUDA's sync debug mode). Writes one JSON (``--json``) and prints a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from gradsift.tools.benchmarking import HookEncoder

# benchmarks/: the shared provenance stamp and worker launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import provenance
from workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
#: Host synchronisations per step the hook may make: the step close's one read, and a spare
#: (the balanced exchange: 4); the budgets of tests/hook/test_host_reads.py, which counts on CPU.
BUDGET = 2
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


def mlp(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(device)


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
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, width, generator=generator).to(device)
        y = torch.randn(16, 8, generator=generator).to(device)
        context = counter.counting() if counter is not None else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def syncs_per_step(
    name: str, exchange: str, device: torch.device, width: int, seed: int = 1
) -> dict[str, Any]:
    """Train a few steps (DDP rebuilds its buckets, PowerSGD starts), then count two."""
    model = DDP(mlp(width, 2, device), bucket_cap_mb=0.05 if device.type == "cpu" else 1)
    if name != "stock":
        gradsift.register_comm_hook(model, build(name), exchange=exchange)
    train_steps(model, 3, device, width, seed=seed)
    counter = SyncCounter(device)
    train_steps(model, 2, device, width, counter, seed=seed)
    return {"syncs_per_step": counter.count / 2, "sites": counter.sites, "model": model}


def equals_stock(device: torch.device, width: int, seed: int = 1) -> bool:
    """``topk`` at ratio 1 through the hook gives stock DDP's parameters, bit for bit."""
    stock = DDP(mlp(width, 2, device))
    hooked = DDP(mlp(width, 2, device))
    gradsift.register_comm_hook(hooked, "topk", ratio=1.0)
    train_steps(stock, 3, device, width, seed=seed)
    train_steps(hooked, 3, device, width, seed=seed)
    return all(torch.equal(a, b) for a, b in zip(stock.parameters(), hooked.parameters(), strict=True))


def check_sync_counter(device: torch.device, small: bool) -> dict[str, Any]:
    counter = SyncCounter(device)
    with counter.counting():
        torch.ones(3, device=device).sum().item()
    failures = (
        [] if counter.count >= 1 else ["the counter missed a .item(): the sync counts below mean nothing"]
    )
    return {"syncs_of_one_item": counter.count, "failures": failures}


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
        out[f"{name} {exchange}"] = entry
    for entry in out.values():
        del entry["model"]
    same = equals_stock(device, width)
    if not same:
        failures.append("topk at ratio 1 differs from stock DDP")
    return {"pairs": out, "topk ratio 1 equals stock DDP": same, "failures": failures}


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
    for name, exchange in [("stock", ""), *pairs()]:
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
        return run_ranks(two_ranks, (f"{tmp}/store", device.type), 2, timeout_s=240)


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
    repeats = 2 if small else 10
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
    repeats = 3 if small else 20
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
    "exchanges": check_exchanges,
    "two_ranks": check_two_ranks,
    "static_graph": check_static_graph,
    "evaluate": check_evaluate,
    "amp": check_amp,
    "encode": check_encode,
    "step_time": check_step_time,
}


def environment(device: torch.device) -> dict[str, Any]:
    """torch, CUDA and NCCL versions and the device (printed first: a failed run still says where it ran)."""
    cuda = device.type == "cuda"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpus": torch.cuda.device_count() if cuda else 0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: toy sizes, gloo")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"check.py: no CUDA GPU visible to torch {torch.__version__}", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    small = device.type == "cpu"
    stamp = provenance.start()
    results: dict[str, Any] = {"environment": environment(device), "checks": {}}
    print(" ".join(f"{key} {value}" for key, value in results["environment"].items()), flush=True)
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
                entry = {"ok": not result.get("failures"), "result": result}
            except Exception:  # one check's failure must not hide the others' results
                entry = {"ok": False, "error": traceback.format_exc(limit=8)}
            entry["seconds"] = round(time.perf_counter() - started, 2)
            results["checks"][name] = entry
            print(f"{name:<14} {'ok' if entry['ok'] else 'FAILED'} {entry['seconds']:7.1f} s", flush=True)
        dist.destroy_process_group()
    results["machine"] = stamp.finish()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary(results)
    return 0 if all(entry["ok"] for entry in results["checks"].values()) else 1


def summary(results: dict[str, Any]) -> None:
    checks = results["checks"]
    for name in ("exchanges", "two_ranks"):
        if "result" in checks.get(name, {}):
            worst = sorted(
                checks[name]["result"]["pairs"].items(), key=lambda item: -item[1]["syncs_per_step"]
            )
            print(f"\n{name}: most host synchronisations per step: "
                  + ", ".join(f"{pair} {entry['syncs_per_step']:g}" for pair, entry in worst[:6]))  # fmt: skip
    if "result" in checks.get("encode", {}):
        print("\nencode ms (x torch.topk):")
        for row in checks["encode"]["result"]["rows"]:
            print(f"  n={row['numel']:>11,} ratio={row['ratio']:<6} {row['method']:<14} {row['encode_ms']:9.3f}"
                  f"  x{row['speedup_vs_torch_topk']:.2f}")  # fmt: skip
    if "result" in checks.get("step_time", {}):
        print(f"\nstep_time: {json.dumps(checks['step_time']['result'], default=str)[:300]}")
    for name, entry in checks.items():
        for failure in entry.get("result", {}).get("failures", []):
            print(f"FAILED {name}: {failure}")
        if "error" in entry:
            print(f"FAILED {name}: {entry['error'].strip().splitlines()[-1]}")


if __name__ == "__main__":
    sys.exit(main())
