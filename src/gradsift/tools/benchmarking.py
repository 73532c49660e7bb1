"""Compressor overhead, measured beside the memory floor and a bare ``torch.topk``.

For every gradient size ``n`` and target density ``ratio``, one *group* of methods
is timed side by side on the same tensor ``x``:

* ``floor``: ``torch.linalg.vector_norm(x, 1)`` -- one read pass over ``x``, the
  least any method that looks at every element can cost;
* ``topk``: ``torch.topk(x.abs(), k, sorted=False)`` -- what a sparsifier must beat;
* each compressor: the DDP hook's own calls (:class:`HookEncoder`), not the public
  ``compress()``/``decompress()``: ``compress`` times ``Compressor.encode`` with the part's
  capacity and the step's readout (what :meth:`gradsift.exchanges.base.Codec.encode`
  calls during backward; no host read), ``decompress`` times ``decompress_into([payload],
  out)``. After each call, untimed, the step closes as in the hook (the readout's one host
  read, the commit of the compressor's state and adaptation, the capacity following the
  demand): the hook pays that once per step, not per bucket. The public ``compress()``
  reads the count and the non-finite flag on the host and trims the payload, so on a GPU
  it waits for the device every call, which the hook never does.

Compressors without a ``ratio`` option (dense casts, quantizers) form one extra group
per size (``ratio=None``). ``threshold`` gets the oracle ``eta`` = the ``k``-th largest
``|x|``, so it selects about ``k``: its time is that of one comparison pass (its
capacity, adaptive as in the hook, has room for them from its second step on, so
after one warm-up call).

Protocol: every method is first called ``warmup`` times on ``x`` (adaptive methods
settle their per-tensor state; allocator and caches warm up), then the group's
methods are called in turn, ``repeats`` rounds, so drift and background load hit
them alike; round ``r`` starts at the ``r``-th method (:func:`in_rotation`), so no
method always follows the same one (a microsecond call measured right after the bare
``torch.topk`` ran ~1.4x faster than the same call after a NumPy-kernel method).
Reported: the median over rounds, per phase. The same ``x`` is
compressed every time (no error feedback), with the same ``key``.

What a time means: the wall clock (``time.perf_counter``) around one call. On CPU the
work runs in the calling process (on ``threads`` threads), so that is its cost. On CUDA
the device is synchronised before and after the call (``torch.cuda.synchronize``), so the
time covers the call's kernels as well as their launches: the device time one bucket's
encode adds to backward's stream (the hook itself never waits for it).

Contended mode (``processes = N > 1``): ``N`` processes (each with ``threads``
threads) run the same measurement at the same time, meeting at a barrier before
every group, so each one's timings are taken while the other ``N - 1`` compete for
the cores -- what ``N`` workers on one machine look like. Rows then hold the median
over all processes' samples, and each process's own median. A process that dies (an
error, the OOM killer) fails the run within about a second; the others are stopped.

Input (:func:`synthetic_gradient`): a heavy-tailed synthetic gradient, fixed seed.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import platform
import queue
import signal
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from gradsift import __version__
from gradsift.compressors import available_compressors, compressor_class, get_compressor
from gradsift.compressors.base import Compressor, target_count
from gradsift.core.errors import GradsiftError
from gradsift.core.payload import Count, Payload
from gradsift.core.readout import Readout
from gradsift.core.validation import check_choice, check_int, check_ratio
from gradsift.hook.capacity import CapacityPlan

T = TypeVar("T")

#: Elements per block of :func:`synthetic_gradient` sharing one scale (a small layer's worth).
SCALE_BLOCK = 4096
#: Longest wait for the next contended worker's result while every worker is alive (a hung
#: worker must not hang the run; one that dies fails it within :data:`_POLL_S`).
_CONTENDED_TIMEOUT_S = 3600
#: Seconds between two looks at the contended workers' exit codes while waiting for results.
_POLL_S = 0.5
#: Labels of the two reference measurements (parenthesised: never a registry name).
FLOOR, TOPK = "(floor)", "(torch.topk)"
INPUT_DESCRIPTION = (
    f"Laplace(0, 1) values times a log-normal scale exp(N(0, 1)) per block of {SCALE_BLOCK} "
    "elements (a scale mixture: layers of different magnitudes, heavier tails than Laplace), "
    "drawn in float32 and cast to the run's dtype"
)
#: ``--dtype`` names -> gradient dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class CompressBenchConfig:
    """What ``gradsift bench compress`` measures (see the module docstring for the protocol).

    Attributes:
        sizes: gradient lengths ``n``.
        ratios: target densities in (0, 1].
        compressors: registry names; ``None`` means every one that can compress a
            flat tensor on its own (the others are reported as skipped, with why).
        repeats: timed rounds per group (median reported), >= 1.
        warmup: untimed calls per method before timing, >= 0.
        threads: ``torch.set_num_threads`` for the run (``None``: leave as is).
        device: ``"cpu"`` or ``"cuda"`` (timings then synchronise the device).
        dtype: the gradient's dtype, a key of :data:`DTYPES` (``"fp32"``, ``"bf16"``, ``"fp16"``).
        seed: seed of the synthetic gradient.
        processes: concurrent processes running the same measurement (>= 1; see the
            module docstring's contended mode).
    """

    sizes: Sequence[int] = (250_000, 1_000_000)
    ratios: Sequence[float] = (0.1, 0.01, 0.001)
    compressors: Sequence[str] | None = None
    repeats: int = 5
    warmup: int = 3
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    processes: int = 1

    def __post_init__(self) -> None:
        self.sizes = [check_int(n, "sizes", low=1) for n in self.sizes]
        self.ratios = [check_ratio(r, "ratios") for r in self.ratios]
        self.repeats = check_int(self.repeats, "repeats", low=1)
        self.warmup = check_int(self.warmup, "warmup", low=0)
        if self.threads is not None:
            self.threads = check_int(self.threads, "threads", low=1)
        self.device = check_choice(self.device, "device", ("cpu", "cuda"))
        self.dtype = check_choice(self.dtype, "dtype", tuple(DTYPES))
        self.seed = check_int(self.seed, "seed", low=0)
        self.processes = check_int(self.processes, "processes", low=1)
        if self.compressors is not None:
            for name in self.compressors:
                compressor_class(name)  # unknown names fail here, before any timing


def synthetic_gradient(
    numel: int, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A heavy-tailed gradient: ``x_i = s_{i // B} * L_i`` (see :data:`INPUT_DESCRIPTION`), drawn in float32.

    ``L_i ~ Laplace(0, 1)`` (a random sign times an ``Exp(1)`` magnitude) and one
    ``s_b = exp(Z_b)``, ``Z_b ~ N(0, 1)``, per block of ``B = 4096`` elements.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(numel).exponential_(generator=generator)
    x *= torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8).mul_(2).sub_(1)
    scales = torch.randn(-(-numel // SCALE_BLOCK), generator=generator).exp_()
    x *= scales.repeat_interleave(SCALE_BLOCK)[:numel]
    return x.to(device, dtype)


class HookEncoder:
    """One flat tensor encoded step after step as the DDP hook encodes a bucket's part.

    :meth:`encode` is the hook's call during backward (the one
    :meth:`gradsift.exchanges.base.Codec.encode` makes): ``Compressor.encode`` with the
    part's capacity from a :class:`~gradsift.hook.capacity.CapacityPlan` (``compressor.capacity(n)``;
    for an adaptive-capacity compressor, the demand of the last kept step) and the step's
    :class:`~gradsift.core.readout.Readout`, inside the state store's transaction; no host read.
    :meth:`close` is the step's close: the readout's one host read, the commit of the
    store and of the compressor's deferred updates (SIDCo's stage choice), the capacity
    following the demand. Time :meth:`encode` alone and :meth:`close` between timings:
    the hook closes once per step, not once per bucket.
    """

    def __init__(self, compressor: Compressor, key: Hashable = 0) -> None:
        self.compressor = compressor
        self.key = key
        self.capacities = CapacityPlan()
        self._open: tuple[Readout, Count, int] | None = None  # the open step: readout, demand, numel

    def encode(self, flat: torch.Tensor) -> Payload:
        """Open a step and encode ``flat`` (1-D) in it, as the hook does; the payload keeps its padding."""
        if self._open is not None:
            raise GradsiftError("HookEncoder.encode: the previous step is still open; close() it first")
        numel = flat.numel()
        readout = Readout()
        store = self.compressor.store
        store.begin()
        try:
            payload = self.compressor.encode(
                flat,
                key=self.key,
                capacity=self.capacities.capacity(self.compressor, self.key, numel),
                readout=readout,
            )
        except BaseException:
            store.rollback()
            raise
        self._open = (readout, payload.entries() if payload.demand is None else payload.demand, numel)
        return payload

    def close(self) -> None:
        """Close the step :meth:`encode` opened, as the hook's step close keeps a step."""
        if self._open is None:
            raise GradsiftError("HookEncoder.close: no step is open; encode() opens one")
        (readout, demand, numel), self._open = self._open, None
        read = readout.slot(torch.as_tensor(demand))  # a host count stays on the host
        readout.read()  # the step's one host read
        self.compressor.store.commit()
        readout.commit()
        self.capacities.follow(self.key, read[0], numel)


def density_option(name: str) -> str | None:
    """The option that sets a compressor's density: ``"ratio"``, ``"threshold"`` or None."""
    return compressor_class(name).density_option


def benchmarkable(names: Sequence[str] | None, device: str) -> tuple[list[str], dict[str, str]]:
    """Split ``names`` (default: the registry) into those that compress a flat tensor and the rest.

    A compressor is skipped, with the reason, when its module does not import, when
    it needs the model's parameters (``needs_parameters``), or when a probe step of the
    hook's encode (:class:`HookEncoder`) of a small tensor raises a gradsift error
    (e.g. PowerSGD, which runs its own collectives).
    """
    usable, skipped = [], {}
    for name in available_compressors() if names is None else names:
        try:
            cls = compressor_class(name)
        except ImportError as error:
            skipped[name] = f"not importable: {error}"
            continue
        if cls.needs_parameters:
            skipped[name] = "needs the model's parameters (needs_parameters); measured in training runs"
            continue
        option = density_option(name)
        try:
            probe = HookEncoder(get_compressor(name, **({} if option is None else {option: 0.5})))
            probe.encode(torch.randn(64, device=device))
            probe.close()
        except GradsiftError as error:
            skipped[name] = str(error)
            continue
        usable.append(name)
    return usable, skipped


def in_rotation(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` starting at position ``round_index mod len(items)``, wrapping around."""
    start = round_index % len(items) if items else 0
    return [*items[start:], *items[:start]]


def interleaved_medians_ms(
    methods: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    inner: int = 1,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median milliseconds per call of each method, timed round-robin so that drift hits all alike.

    Each method is called ``warmup`` times first; then ``repeats`` rounds time every
    method in turn (:func:`in_rotation`), ``inner`` calls per timing (resolution for
    microsecond calls), read on ``clock`` (seconds; the wall clock unless told otherwise).
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_index in range(repeats):
        for name, fn in in_rotation(list(methods.items()), round_index):
            start = clock()
            for _ in range(inner):
                fn()
            times[name].append((clock() - start) * 1e3 / inner)
    return {name: statistics.median(samples) for name, samples in times.items()}


def _synchronizer(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


@dataclass
class _Method:
    """One timed method of a group: ``run()`` returns a payload (or a tensor for baselines);
    ``close()`` runs untimed after each call (a compressor's step close)."""

    label: str
    run: Callable[[], Any]
    decompress: Callable[[Any], torch.Tensor] | None = None
    options: dict[str, Any] | None = None  # a compressor's options; None for the baselines
    close: Callable[[], None] = lambda: None


def _group_methods(x: torch.Tensor, ratio: float | None, names: Sequence[str]) -> list[_Method]:
    """The floor, (for a ratio) bare top-k, and a fresh instance of each compressor."""
    numel = x.numel()
    out = torch.empty_like(x)  # the bucket's result the hook decodes into, one for the group
    methods = [_Method(FLOOR, lambda: torch.linalg.vector_norm(x, 1))]
    if ratio is not None:
        k = target_count(numel, ratio)
        methods.append(_Method(TOPK, lambda: torch.topk(x.abs(), k, sorted=False)))
        oracle_eta = float(torch.topk(x.abs(), k, sorted=False).values.min())
    for name in names:
        option = density_option(name)
        if (option is None) != (ratio is None):
            continue
        options = {} if option is None else {option: oracle_eta if option == "threshold" else ratio}
        methods.append(_compressor_method(name, get_compressor(name, **options), x, out))
    return methods


def _compressor_method(name: str, compressor: Compressor, x: torch.Tensor, out: torch.Tensor) -> _Method:
    """The hook's encode of ``x`` and decode of its payload into ``out``, as a timed method."""
    encoder = HookEncoder(compressor)

    def run() -> Payload:
        return encoder.encode(x)

    def decompress(payload: Payload) -> torch.Tensor:
        compressor.decompress_into([payload], out)
        return out

    return _Method(name, run, decompress, compressor.options(), encoder.close)


def _measure_group(
    methods: Sequence[_Method], config: CompressBenchConfig, progress: tqdm
) -> dict[str, dict[str, list]]:
    """Warm up each method, then time ``repeats`` interleaved rounds; raw samples per label."""
    sync = _synchronizer(config.device)
    samples: dict[str, dict[str, list]] = {
        m.label: {"compress": [], "decompress": [], "count": [], "nbytes": []} for m in methods
    }

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - start) * 1e3

    for method in methods:
        for _ in range(config.warmup):
            out = method.run()
            if method.decompress is not None:
                method.decompress(out)
            method.close()
            progress.update(1)
    for round_index in range(config.repeats):
        for method in in_rotation(methods, round_index):
            out, ms = timed(method.run)
            record = samples[method.label]
            record["compress"].append(ms)
            if method.decompress is not None:
                record["decompress"].append(timed(functools.partial(method.decompress, out))[1])
                record["count"].append(out.count)  # entries in use (a host read, untimed)
                record["nbytes"].append(out.nbytes)  # on the wire: padding to capacity included
            method.close()
            del out
            progress.update(1)
    return samples


def _groups(config: CompressBenchConfig, names: Sequence[str]) -> list[float | None]:
    """The ratios timed per size: each configured ratio if any compressor takes one, then None for the rest."""
    ratio_less = any(density_option(name) is None for name in names)
    with_ratio = any(density_option(name) is not None for name in names)
    return [*(config.ratios if with_ratio else []), *([None] if ratio_less else [])]


def _measure_all(
    config: CompressBenchConfig, names: Sequence[str], *, progress: bool = False, barrier: Any = None
) -> list[dict[str, Any]]:
    """Raw samples of every (size, ratio) group, in order: ``[{numel, ratio, options, samples}]``.

    ``barrier`` (contended mode) is waited on before each group, so that concurrent
    processes time the same group at the same time.
    """
    ratios = _groups(config, names)
    per_group = {ratio: 1 + (ratio is not None) + sum((density_option(n) is None) == (ratio is None) for n in names)
                 for ratio in ratios}  # fmt: skip
    total = sum(per_group.values()) * len(config.sizes) * (config.warmup + config.repeats)
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    groups = []
    try:
        with tqdm(total=total, desc="bench compress", unit="call", disable=not progress) as bar:
            for numel in config.sizes:
                x = synthetic_gradient(numel, config.seed, config.device, DTYPES[config.dtype])
                for ratio in ratios:
                    bar.set_postfix(numel=numel, ratio=ratio)
                    methods = _group_methods(x, ratio, names)
                    if barrier is not None:
                        barrier.wait()
                    groups.append({
                        "numel": numel, "ratio": ratio, "element_size": x.element_size(),
                        "options": {m.label: m.options for m in methods if m.options is not None},
                        "samples": _measure_group(methods, config, bar),
                    })  # fmt: skip
                del x
    finally:
        torch.set_num_threads(previous_threads)
    return groups


def _contended_worker(config: CompressBenchConfig, names: Sequence[str], barrier: Any, results: Any) -> None:
    """One process of the contended mode: measure everything, put ``(pid, groups)`` on ``results``."""
    results.put((os.getpid(), _measure_all(config, names, barrier=barrier)))


def _measure_in_processes(config: CompressBenchConfig, names: Sequence[str]) -> list[list[dict[str, Any]]]:
    """Run :func:`_measure_all` in ``config.processes`` concurrent processes; their groups, by process."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(config.processes), context.Queue()
    workers = [
        context.Process(target=_contended_worker, args=(config, names, barrier, results))
        for _ in range(config.processes)
    ]
    for worker in workers:
        worker.start()
    collected: dict[int, list[dict[str, Any]]] = {}
    try:
        _collect(workers, results, collected)
    finally:  # the others wait at the barrier for the dead one: stop them
        for worker in workers:
            worker.join(timeout=10 if len(collected) == len(workers) else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()
    return [collected[pid] for pid in sorted(collected)]


def _collect(workers: Sequence[Any], results: Any, collected: dict[int, Any]) -> None:
    """Fill ``collected`` with each worker's ``(pid, groups)`` from ``results``.

    Never one long blocking ``get``: every :data:`_POLL_S` seconds without a result, the
    workers' exit codes are read, and a worker that ended without sending its result
    (an error, a signal such as the OOM killer's) raises :class:`GradsiftError` at once.
    """
    waiting_since = time.monotonic()
    while len(collected) < len(workers):
        # read before the get: what a worker that has exited sent is already in the pipe
        ended = [worker for worker in workers if worker.exitcode is not None]
        try:
            pid, groups = results.get(timeout=_POLL_S)
        except queue.Empty:
            lost = [worker for worker in ended if worker.pid not in collected]
            if lost:
                raise GradsiftError(
                    "bench compress: contended worker(s) ended without sending their results: "
                    f"{_exits(workers, lost)} (a worker's traceback, if it raised, is on stderr above)"
                ) from None
            if time.monotonic() - waiting_since > _CONTENDED_TIMEOUT_S:
                raise GradsiftError(
                    f"bench compress: no further contended result came in {_CONTENDED_TIMEOUT_S} s "
                    f"({_exits(workers, workers)})"
                ) from None
            continue
        collected[pid] = groups
        waiting_since = time.monotonic()


def exit_status(code: int | None) -> str:
    """A process's ``exitcode`` in words: ``running``, ``signal SIGKILL`` or ``exit code 1``."""
    if code is None:
        return "running"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _exits(workers: Sequence[Any], which: Sequence[Any]) -> str:
    """``worker 1 of 2 (pid 123): signal SIGKILL`` for each of ``which`` (``running`` while alive)."""
    described = []
    for worker in which:
        how = exit_status(worker.exitcode)
        described.append(f"worker {workers.index(worker)} of {len(workers)} (pid {worker.pid}): {how}")
    return ", ".join(described)


def _pooled(per_process: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One group measured by several processes: the samples of all of them, concatenated."""
    first = per_process[0]
    samples = {
        label: {
            phase: [v for group in per_process for v in group["samples"][label][phase]] for phase in phases
        }
        for label, phases in first["samples"].items()
    }
    by_process = {
        label: [statistics.median(group["samples"][label]["compress"]) for group in per_process]
        for label in first["samples"]
    }
    return {**first, "samples": samples, "compress_ms_by_process": by_process}


def _row(name: str, group: dict[str, Any]) -> dict[str, Any]:
    """One result row: medians, achieved vs target count, ratios to the floor, to top-k and to ``topk``."""
    numel, ratio, samples = group["numel"], group["ratio"], group["samples"]
    own = samples[name]
    compress_ms = statistics.median(own["compress"])
    floor_ms = statistics.median(samples[FLOOR]["compress"])
    topk_ms = statistics.median(samples[TOPK]["compress"]) if TOPK in samples else None
    topk_compressor_ms = statistics.median(samples["topk"]["compress"]) if "topk" in samples else None
    target = target_count(numel, ratio) if ratio is not None else numel
    count = statistics.mean(own["count"])
    row = {
        "compressor": name,
        "options": group["options"][name],
        "numel": numel,
        "ratio": ratio,
        "target_count": target,
        "count": count,
        "count_vs_target": count / target,
        "compress_ms": compress_ms,
        "decompress_ms": statistics.median(own["decompress"]),
        "floor_ms": floor_ms,
        "topk_ms": topk_ms,
        "compress_vs_floor": compress_ms / floor_ms,
        "speedup_vs_topk": topk_ms / compress_ms if topk_ms is not None else None,
        "speedup_vs_topk_compressor": topk_compressor_ms / compress_ms
        if topk_compressor_ms is not None
        else None,
        "nbytes": statistics.mean(own["nbytes"]),
        "dense_nbytes": numel * group["element_size"],
    }
    if "compress_ms_by_process" in group:
        row["compress_ms_by_process"] = group["compress_ms_by_process"][name]
    return row


def run_compress_benchmark(config: CompressBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns ``{"config", "input", "environment", "skipped", "rows"}``.

    Each row: ``compressor``, ``options``, ``numel``, ``ratio`` (None for ratio-less
    compressors), ``target_count`` (``k``; ``numel`` without a ratio), ``count`` (mean
    entries in use of the hook's payload), ``count_vs_target``, medians ``compress_ms``
    (the hook's encode) and ``decompress_ms`` (its ``decompress_into``), ``floor_ms``,
    ``topk_ms`` (bare ``torch.topk``; None without a ratio), ``compress_vs_floor``,
    ``speedup_vs_topk`` (``topk_ms / compress_ms``), ``speedup_vs_topk_compressor`` (the
    ``topk`` compressor's ``compress_ms`` over this one's; None when ``topk`` is not in
    the run or there is no ratio), ``nbytes`` (mean bytes of the payload the hook sends,
    its padding to capacity included) and ``dense_nbytes`` (``n`` times the element size). In the
    contended mode rows add ``compress_ms_by_process`` (each process's median) and the
    medians are over every process's samples.
    """
    names, skipped = benchmarkable(config.compressors, config.device)
    # Other processes on the machine inflate medians: the load averages (1, 5, 15 min) before and after.
    load_before = os.getloadavg()
    started = time.perf_counter()
    if config.processes == 1:
        groups = _measure_all(config, names, progress=progress)
    else:
        groups = [_pooled(together) for together in zip(*_measure_in_processes(config, names), strict=True)]
    wall_s = time.perf_counter() - started
    load_after = os.getloadavg()
    rows = [_row(name, group) for group in groups for name in group["options"]]
    return {
        "config": {**asdict(config), "compressors": names},
        "input": INPUT_DESCRIPTION,
        "environment": {
            "gradsift": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": config.threads or torch.get_num_threads(),
            "load_average": {"before": list(load_before), "after": list(load_after)},
            "wall_s": wall_s,
            "device": torch.cuda.get_device_name() if config.device == "cuda" else platform.processor(),
        },
        "skipped": skipped,
        "rows": rows,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`run_compress_benchmark`'s rows, grouped by size and ratio."""
    header = [
        "compressor",
        "n",
        "ratio",
        "count/k",
        "compress ms",
        "decompress ms",
        "x floor",
        "vs topk",
        "vs topk-c",
        "MB",
    ]
    lines = []
    group = None
    for row in result["rows"]:
        if (row["numel"], row["ratio"]) != group:
            group = (row["numel"], row["ratio"])
            topk = f", bare topk {row['topk_ms']:.2f} ms" if row["topk_ms"] is not None else ""
            lines.append([f"# n={row['numel']:,} ratio={row['ratio']}: floor {row['floor_ms']:.2f} ms{topk}"])
        lines.append([
            row["compressor"], f"{row['numel']:,}", _fmt(row["ratio"], "g"), f"{row['count_vs_target']:.3f}",
            f"{row['compress_ms']:.2f}", f"{row['decompress_ms']:.2f}", f"{row['compress_vs_floor']:.1f}",
            _fmt(row["speedup_vs_topk"], ".2f"), _fmt(row["speedup_vs_topk_compressor"], ".2f"),
            f"{row['nbytes'] / 1e6:.3f}",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in [header, *lines] if len(line) > 1) for i in range(len(header))]
    text = []
    for line in [header, *lines]:
        if len(line) == 1:
            text.append(line[0])
        else:
            cells = [
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            ]
            text.append("  ".join(cells))
    text.extend(f"skipped {name}: {reason}" for name, reason in result["skipped"].items())
    return "\n".join(text)
