"""One GPU, a few minutes: does gradsift's hook path run on CUDA + NCCL without waiting on the host?

Run by ``benchmarks/gpu/check.sh`` (which also runs the CUDA tests and the demo's quick
mode). Each check is independent, has its own result entry and never stops the others:

* ``exchanges``: a world-size-1 NCCL process group; for every exchange (allgather,
  balanced, shared-mask, allreduce, delegated) and the compressors that travel by it
  (``sidco-exp`` on both of its paths, ``topk``, ``dgc``, ``qsgd``, ``vgc``, ``fp16``,
  ``powersgd``), a DDP model trains a few steps under
  ``torch.cuda.set_sync_debug_mode("warn")``; the synchronising calls of each step are
  counted (the warnings, and where they came from); ``topk`` at ratio 1 must give stock
  DDP's gradients exactly.
* ``static_graph``: DDP(static_graph=True) with the hook completes its steps.
* ``evaluate``: the trainer's evaluation on a CUDA model under NCCL.
* ``amp``: autocast fp16 + ``GradScaler`` + SGD with weight decay, ``topk`` at ratio 1
  with ``optimizer=`` and ``scaler=``, against stock DDP (relative parameter difference).
* ``compress``: ``sidco-exp``, ``topk``, ``dgc`` at three sizes (2^16, 2^20, 2^24),
  median time (CUDA events), and the exact/fit crossover of SIDCo measured there.
* ``step_time``: stock DDP against the hook (``none``, ``topk``, ``sidco-exp`` at 0.01) on an
  MLP of 4 x Linear(2048, 2048), median of 20 steps.

``--device cpu`` runs every check on CPU with gloo at toy sizes (how the test suite checks
this script; host reads are then counted with the test suite's counter instead of CUDA's
sync debug mode). Writes one JSON (``--json``) and prints a short table.
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
from gradsift.readout import Readout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [
    ("sidco-exp", "allgather"),
    ("sidco-exp/fit", "allgather"),
    ("topk", "allgather"),
    ("dgc", "allgather"),
    ("qsgd", "allgather"),
    ("vgc", "allgather"),
    ("sidco-exp/fit", "balanced"),
    ("topk", "balanced"),
    ("sidco-exp/fit", "shared-mask"),
    ("topk", "shared-mask"),
    ("fp16", "allreduce"),
    ("randomk", "allreduce"),
    ("powersgd", "delegated"),
]


def build(name: str) -> gradsift.Compressor:
    if name == "sidco-exp/fit":
        return gradsift.get_compressor("sidco-exp", exact_below=0)
    return gradsift.get_compressor(name, **({"start_iter": 2} if name == "powersgd" else {}))


def mlp(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(device)


class SyncCounter:
    """Counts the host synchronisations in a block: CUDA's sync debug warnings on a GPU, the
    test suite's host-read counter on CPU (tests/host_reads.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count = 0
        self.sites: dict[str, int] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if self.device.type != "cuda":
            sys.path.insert(0, str(ROOT / "tests"))
            from host_reads import HostReads

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
    model: DDP, steps: int, device: torch.device, width: int, counter: SyncCounter | None = None
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, width, generator=generator).to(device)
        y = torch.randn(16, 8, generator=generator).to(device)
        context = counter.counting() if counter is not None else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def check_exchanges(device: torch.device, small: bool) -> dict[str, Any]:
    width = 64 if small else 512
    out: dict[str, Any] = {}
    for name, exchange in PAIRS:
        model = DDP(mlp(width, 2, device), bucket_cap_mb=0.05 if small else 1)
        gradsift.register_comm_hook(model, build(name), exchange=exchange)
        train_steps(model, 3, device, width)  # warm: DDP rebuilds its buckets, PowerSGD starts
        counter = SyncCounter(device)
        train_steps(model, 2, device, width, counter)
        out[f"{name} {exchange}"] = {"syncs_per_step": counter.count / 2, "sites": counter.sites}
    stock = DDP(mlp(width, 2, device))
    hooked = DDP(mlp(width, 2, device))
    gradsift.register_comm_hook(hooked, "topk", ratio=1.0)
    train_steps(stock, 3, device, width)
    train_steps(hooked, 3, device, width)
    same = all(torch.equal(a, b) for a, b in zip(stock.parameters(), hooked.parameters(), strict=True))
    out["topk ratio 1 equals stock DDP"] = same
    return out


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
    from gradsift.train.data import synthetic_split
    from gradsift.train.loop import evaluate
    from gradsift.train.models import build_model

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
    return {"relative_difference": difference, "target": 1e-4}


def timed(function: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``function`` (CUDA events on a GPU)."""
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
    return statistics.median(times[2:])


def check_compress(device: torch.device, small: bool) -> dict[str, Any]:
    sizes = [1 << 12, 1 << 14] if small else [1 << 16, 1 << 20, 1 << 24]
    repeats = 3 if small else 15
    rows = []
    for numel in sizes:
        x = torch.randn(numel, device=device)
        for label, compressor in (
            ("topk", gradsift.get_compressor("topk", ratio=0.01)),
            ("sidco-exp exact", gradsift.get_compressor("sidco-exp", ratio=0.01, exact_below=numel + 1)),
            ("sidco-exp fit", gradsift.get_compressor("sidco-exp", ratio=0.01, exact_below=0)),
            ("dgc", gradsift.get_compressor("dgc", ratio=0.01)),
        ):
            capacity = compressor.capacity(numel)
            readout = Readout()
            ms = timed(lambda c=compressor, k=capacity, x=x, r=readout: c.encode(x, key=0, capacity=k, readout=r),
                       device, repeats)  # fmt: skip
            rows.append({"numel": numel, "compressor": label, "encode_ms": ms})
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
    "exchanges": check_exchanges,
    "static_graph": check_static_graph,
    "evaluate": check_evaluate,
    "amp": check_amp,
    "compress": check_compress,
    "step_time": check_step_time,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: toy sizes, gloo")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    small = device.type == "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        stamp = provenance.start()
        results: dict[str, Any] = {"machine": {**stamp.record, "cuda": torch.version.cuda}, "checks": {}}
        for name in args.only or list(CHECKS):
            started = time.perf_counter()
            try:
                entry = {"ok": True, "result": CHECKS[name](device, small)}
            except Exception:  # one check's failure must not hide the others' results
                entry = {"ok": False, "error": traceback.format_exc(limit=8)}
            entry["seconds"] = round(time.perf_counter() - started, 2)
            results["checks"][name] = entry
            print(f"{name:<14} {'ok' if entry['ok'] else 'FAILED'} {entry['seconds']:7.1f} s", flush=True)
        dist.destroy_process_group()
    results["machine"] = {**stamp.finish(), "cuda": torch.version.cuda}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary(results)
    return 0 if all(entry["ok"] for entry in results["checks"].values()) else 1


def summary(results: dict[str, Any]) -> None:
    checks = results["checks"]
    exchanges = checks.get("exchanges", {})
    if exchanges.get("ok"):
        print("\nhost synchronisations per step:")
        for pair, value in exchanges["result"].items():
            if isinstance(value, dict):
                print(f"  {pair:<28} {value['syncs_per_step']:5.1f}")
            else:
                print(f"  {pair:<28} {value}")
    for name in ("amp", "step_time"):
        if checks.get(name, {}).get("ok"):
            print(f"{name}: {json.dumps(checks[name]['result'], default=str)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
