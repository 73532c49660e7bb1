"""Peak memory per rank of each method against stock DDP, measured and expected from the code.

Two gloo ranks train an MLP of ``DEPTH`` x Linear(1024, 1024) + Linear(1024, 10)
(9 456 650 fp32 parameters, 37.8 MB; ``--width`` sets another width; batch 32 per rank, so
the activations are small beside the per-parameter state) for ``--steps`` steps of SGD with
momentum 0.9 and of AdamW (``--optimizers``), once per arm (:data:`ARMS`; ``--arms``, stock
DDP always): stock DDP (no hook), the hook with ``none``,
``bf16``, ``topk`` and ``sidco-exp`` (ratio 0.01), ``efsignsgd`` under AdamW (the
1-bit Adam method), ``powersgd``, and ``gradsift.diloco`` (no DDP). The Adam methods'
dense warm-up and PowerSGD's ``start_iter`` are ``DENSE_STEPS``, so most steps are
compressed; DiLoCo's round is ``SYNC_EVERY`` steps.

Measured: the peak resident set size of each rank (``getrusage``'s ``ru_maxrss``, which
only grows, so every arm runs in two fresh spawned processes) minus the rank's RSS just
before the arm's DDP model is built (after the imports, the process group and the bare
model), so what the interpreter and torch occupy cancels; the same for the RSS after
the last step and the ``zero_grad`` that opens the next (what stays between steps: the
Adam methods' step clears the ``.grad`` of the parameters it steps, stock AdamW's stay until
then), for malloc's in-use bytes at that point (``mallinfo2``: the live tensors, without
what the allocator keeps after a free),
and for the largest in-use bytes polled during the steps (:class:`AllocatedPeak`: the
live tensors' peak; the RSS peak above it is what glibc kept after frees).
An arm's extra is its growth minus stock DDP's under the same optimizer, on the same
rank; the larger of the two ranks' is reported.

glibc's tunables set in the environment (``MALLOC_MMAP_THRESHOLD_=131072`` for docs/memory.md's
allocator note) are recorded with the result as ``allocator``.

Expected: :data:`ARMS` lists, per arm, the per-parameter tensors it keeps over stock DDP,
the stock ones it does without, those alive only until the step commits (the
transaction's old state beside the new, a payload in flight), and those alive only while one
bucket is encoded (the sparsifiers under momentum correction: the compensated gradient, their
new velocity waiting in the bucket's own memory until the close commits it);
:func:`expected_bytes` counts them for a model and its largest bucket. Usage (repository
root, a clean checkout of a commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/memory/peak.py --json results/memory/peak.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, ranks, results
import provenance
from paths import results_dir
from workers import run_ranks

WIDTH, DEPTH, BATCH, WORLD = 1024, 9, 32, 2
#: The Adam methods' dense warm-up (``warmup_steps``) and PowerSGD's ``start_iter``.
DENSE_STEPS = 5
#: DiLoCo's inner steps per round (``sync_every``).
SYNC_EVERY = 5
OPTIMIZERS = ("sgd", "adamw")
FP32 = 4


@dataclass(frozen=True)
class Arm:
    """One measured configuration and what the code keeps for it per parameter, over stock DDP.

    ``kept``: tensors alive between steps; ``dropped``: stock DDP's own that the arm does
    without; ``in_step``: tensors alive only until the step commits or rolls back; each is
    ``(what, bytes per parameter element)``. ``in_bucket``: tensors alive only while one
    bucket is encoded, ``(what, bytes per element of the bucket)``, counted for the largest.
    """

    label: str
    method: str | None  # a registry name for the hook, "diloco", or None (stock DDP)
    optimizers: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()
    kept: tuple[tuple[str, int], ...] = ()
    dropped: tuple[tuple[str, int], ...] = ()
    in_step: tuple[tuple[str, int], ...] = ()
    adamw_kept: tuple[tuple[str, int], ...] = ()  # added to ``kept`` under AdamW (the frozen-variance method)
    sgd_dropped: tuple[tuple[str, int], ...] = ()  # added to ``dropped`` under SGD (momentum correction)
    in_bucket: tuple[tuple[str, int], ...] = ()

    def tensors(self, optimizer: str) -> dict[str, tuple[tuple[str, int], ...]]:
        """``kept``, ``dropped``, ``in_step`` and ``in_bucket`` under ``optimizer``."""
        adamw = optimizer == "adamw"
        return {
            "kept": self.kept + (self.adamw_kept if adamw else ()),
            "dropped": self.dropped + (() if adamw else self.sgd_dropped),
            "in_step": self.in_step,
            "in_bucket": self.in_bucket,
        }


RESIDUAL, VELOCITY = ("residual", FP32), ("velocity", FP32)
#: Under momentum correction (SGD's, the frozen-variance Adam method's) the new velocity of
#: the sparsifiers and of a code (``efsignsgd``) waits in the bucket's own memory and the
#: close commits it and the residual in place (hook.feedback, step 3, in the result): ``c``
#: lives while its bucket is encoded.
IN_RESULT = (("compensated gradient of the bucket being encoded (the new velocity in the bucket)", FP32),)
MOMENTUM_BUFFER = (("SGD momentum buffer", FP32),)
PRECONDITIONER = (("frozen preconditioner sqrt(v) + eps", FP32),)
#: Beside the stored (old) residual: the compensated gradient, made the new residual in place.
COMPENSATED = ("compensated gradient, then the new residual", FP32)
SPARSIFIER = {
    "kept": (RESIDUAL, VELOCITY),
    "in_bucket": IN_RESULT,
    "adamw_kept": PRECONDITIONER,
    "sgd_dropped": MOMENTUM_BUFFER,
}
ARMS = (
    Arm("stock", None, OPTIMIZERS),
    Arm("none", "none", OPTIMIZERS),
    Arm("bf16", "bf16", OPTIMIZERS, kept=(("bf16 mean, held by its allreduce's handle until the next step", 2),),
        in_step=(("bf16 payload", 2),)),
    Arm("topk", "topk", OPTIMIZERS, (("ratio", 0.01),), **SPARSIFIER),
    Arm("sidco-exp", "sidco-exp", OPTIMIZERS, (("ratio", 0.01),), **SPARSIFIER),
    Arm("efsignsgd", "efsignsgd", ("adamw",), kept=(RESIDUAL, VELOCITY), in_bucket=IN_RESULT,
        adamw_kept=PRECONDITIONER),
    Arm("powersgd", "powersgd", OPTIMIZERS, (("start_iter", DENSE_STEPS),), kept=(RESIDUAL,),
        in_step=(COMPENSATED,)),  # the optimizer keeps its moments, SGD's and AdamW's
    Arm("diloco", "diloco", OPTIMIZERS, (("sync_every", SYNC_EVERY),),
        kept=(("shared parameters (the model's copy)", FP32), RESIDUAL),
        dropped=(("DDP's gradient buckets", FP32),),
        in_step=(("pseudo-gradient (the mean, then the outer gradient's views)", FP32), COMPENSATED)),
)  # fmt: skip


def expected_bytes(
    arm: Arm, optimizer: str, model: torch.nn.Module, largest_bucket: int | None = None
) -> dict[str, int]:
    """Bytes over stock DDP that ``arm`` keeps between steps (``kept``) and holds at its peak,
    until the step commits (``peak``), for ``model``'s trainable parameters and the elements
    of its largest bucket (None: one bucket of them all)."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = arm.tensors(optimizer)
    per = {part: sum(size for _, size in tensors[part]) for part in tensors}
    kept = numel * (per["kept"] - per["dropped"])
    bucket = numel if largest_bucket is None else largest_bucket
    return {"kept": kept, "peak": kept + numel * per["in_step"] + bucket * per["in_bucket"]}


def make_model(width: int = WIDTH) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # lr 1e-4: at 1e-3 the frozen-variance method diverges on this deep ReLU MLP after its
    # 5-step warm-up (NaN by the 10th step, docs/decisions.md), and the arm would measure NaNs
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def rss_now() -> int:
    """This process's resident set size now, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


_LIBC = ctypes.CDLL(None)
_LIBC.mallinfo2.restype = _MallInfo2


def allocated_now() -> int:
    """Bytes glibc's malloc has handed out and not had back (every arena and mmapped chunk):
    the live tensors, without what the allocator keeps after a free."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class AllocatedPeak:
    """The largest :func:`allocated_now` seen while the ``with`` block runs, polled every
    ``period_s`` on a thread of its own (PyTorch's kernels release the GIL, so it polls
    inside them too; an allocation shorter than the period can be missed)."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.peak = allocated_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, allocated_now())

    def __enter__(self) -> AllocatedPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated_now())


def rss_peak() -> int:
    """The largest resident set size this process has had, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(
    arm: Arm, optimizer_name: str, module: torch.nn.Module
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model the steps run on, its optimizer, and the hook's state (None without the hook),
    with ``arm``'s method installed."""
    if arm.method == "diloco":
        optimizer = make_optimizer(optimizer_name, module)
        gradsift.diloco(module, optimizer, **dict(arm.options))
        return module, optimizer, None
    model = DDP(module)
    optimizer = make_optimizer(optimizer_name, module)
    if arm.method is None:
        return model, optimizer, None
    options = dict(arm.options, optimizer=optimizer)
    if optimizer_name == "adamw":  # the frozen-variance warm-up (none, bf16: 5 stock steps)
        options["warmup_steps"] = DENSE_STEPS
    return model, optimizer, gradsift.register_comm_hook(model, arm.method, **options)


def largest_bucket(state: Any) -> int | None:
    """Elements of the largest bucket the hook keeps a velocity for (the bucket granularity's
    state is one tensor per bucket; None when it keeps none)."""
    velocities = [] if state is None else state.store.table("velocity").values()
    return max((tensor.numel() for tensor in velocities), default=None)


def worker(
    rank: int, store_path: str, arm: Arm, optimizer_name: str, steps: int, width: int, queue: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, store=dist.FileStore(store_path, WORLD))
    module = make_model(width)
    start, allocated = rss_now(), allocated_now()
    model, optimizer, state = build(arm, optimizer_name, module)
    generator = torch.Generator().manual_seed(rank)
    with AllocatedPeak() as allocated_peak:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = (
                torch.randn(BATCH, width, generator=generator),
                torch.randint(0, 10, (BATCH,), generator=generator),
            )
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine = {"start": start, "peak": rss_peak(), "end": rss_now(), "allocated_start": allocated,
            "allocated_end": allocated_now(), "allocated_peak": allocated_peak.peak,
            "largest_bucket": largest_bucket(state)}  # fmt: skip
    ranks: list[Any] = [None] * WORLD
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        queue.put(ranks)
    dist.barrier()
    dist.destroy_process_group()


def measure(arm: Arm, optimizer: str, steps: int, width: int = WIDTH) -> list[dict[str, int]]:
    """Each rank's RSS at the start, its peak and its RSS at the end, and malloc's live bytes
    at the start and the end, in fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        return run_ranks(worker, (store, arm, optimizer, steps, width), WORLD, timeout_s=600)


def summarise(arm: Arm, optimizer: str, ranks: list[dict[str, int]], stock: list[dict[str, int]],
              model: torch.nn.Module) -> dict[str, Any]:  # fmt: skip
    """An arm's row: its ranks, its measured extra over stock (the larger rank's), the expectation."""
    numel = sum(p.numel() for p in model.parameters())
    extra = {
        key: max((r[key] - r[start]) - (s[key] - s[start]) for r, s in zip(ranks, stock, strict=True))
        for key, start in (("peak", "start"), ("end", "start"), ("allocated_end", "allocated_start"),
                           ("allocated_peak", "allocated_start"))
    }  # fmt: skip
    expected = expected_bytes(arm, optimizer, model, ranks[0]["largest_bucket"])
    return {
        "arm": arm.label,
        "optimizer": optimizer,
        "options": dict(arm.options),
        "ranks": ranks,
        "extra_peak_bytes": extra["peak"],
        "extra_end_bytes": extra["end"],
        "extra_peak_per_parameter": extra["peak"] / numel,
        "extra_peak_over_parameter_bytes": extra["peak"] / (FP32 * numel),
        "extra_end_per_parameter": extra["end"] / numel,
        "extra_allocated_end_per_parameter": extra["allocated_end"] / numel,
        "extra_allocated_peak_per_parameter": extra["allocated_peak"] / numel,
        "extra_allocated_peak_over_parameter_bytes": extra["allocated_peak"] / (FP32 * numel),
        "largest_bucket": ranks[0]["largest_bucket"],
        "expected_peak_per_parameter": expected["peak"] / numel,
        "expected_kept_per_parameter": expected["kept"] / numel,
        "expected": {part: [f"{what} ({size} B)" for what, size in tensors]
                     for part, tensors in arm.tensors(optimizer).items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per arm (default: 20)")
    parser.add_argument("--json", type=Path, default=results_dir(__file__) / "peak.json")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"the MLP's width (default: {WIDTH})")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="optimizers to run (default: all)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=[a.label for a in ARMS], default=[a.label for a in ARMS],
                        help="arms to run; stock DDP, the baseline, always runs first (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps <= max(DENSE_STEPS, SYNC_EVERY):
        parser.error(
            f"--steps must exceed the dense warm-up and DiLoCo's round ({max(DENSE_STEPS, SYNC_EVERY)})"
        )
    stamp = provenance.start(seeds=sorted({0, *range(WORLD)}))  # the model's seed, each rank's batches
    model, rows = make_model(args.width), []
    for optimizer in args.optimizers:
        stock: list[dict[str, int]] = []
        chosen = {"stock", *args.arms}
        for arm in (a for a in ARMS if optimizer in a.optimizers and a.label in chosen):
            ranks = measure(arm, optimizer, args.steps, args.width)
            stock = stock or ranks
            rows.append(summarise(arm, optimizer, ranks, stock, model))
            row = rows[-1]
            print(f"{optimizer:>5} {arm.label:>10}: peak +{row['extra_peak_per_parameter']:6.2f} B/param "
                  f"(expected {row['expected_peak_per_parameter']:5.1f}; live tensors "
                  f"+{row['extra_allocated_peak_per_parameter']:6.2f}), after the steps "
                  f"+{row['extra_end_per_parameter']:6.2f}, allocated +{row['extra_allocated_end_per_parameter']:6.2f} (expected {row['expected_kept_per_parameter']:5.1f})",
                  flush=True)  # fmt: skip
    numel = sum(p.numel() for p in model.parameters())
    stamp.write(
        args.json,
        args,
        model=f"MLP {DEPTH} x Linear({args.width}, {args.width}) + Linear({args.width}, 10), batch {BATCH} per rank",
        parameters=numel,
        parameter_bytes=FP32 * numel,
        world_size=WORLD,
        dense_steps=DENSE_STEPS,
        measured="per rank: ru_maxrss (peak) and /proc/self/statm (end) minus the RSS before DDP; "
        "glibc mallinfo2 in-use bytes after the steps, and their largest value polled every 0.5 ms "
        "during the steps, minus before DDP",
        allocator={name: value for name, value in sorted(os.environ.items()) if name.startswith("MALLOC_")},
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
