"""Compressor overhead, measured beside the memory floor and a bare ``torch.topk``.

For every gradient size ``n`` and target density ``ratio``, one *group* of methods
is timed side by side on the same tensor ``x``:

* ``floor``: ``torch.linalg.vector_norm(x, 1)`` -- one read pass over ``x``, the
  least any method that looks at every element can cost;
* ``topk``: ``torch.topk(x.abs(), k, sorted=False)`` -- what a sparsifier must beat;
* each compressor: ``compress(x)`` and ``decompress([payload], n)``.

Compressors without a ``ratio`` option (dense casts, quantizers) form one extra group
per size (``ratio=None``). ``threshold`` gets the oracle ``eta`` = the ``k``-th largest
``|x|``, so it selects about ``k``: its time is that of one comparison pass.

Protocol: every method is first called ``warmup`` times on ``x`` (adaptive methods
settle their per-tensor state; allocator and caches warm up), then the group's
methods are called in turn, ``repeats`` rounds, so drift and background load hit
them alike. Reported: the median over rounds, per phase. The same ``x`` is
compressed every time (no error feedback), with the same ``key``.

Input (:func:`synthetic_gradient`): a heavy-tailed synthetic gradient, fixed seed.
"""

from __future__ import annotations

import inspect
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from gradsift import __version__
from gradsift.compressors import Compressor, available_compressors, compressor_class, get_compressor
from gradsift.compressors.base import target_count
from gradsift.errors import GradsiftError
from gradsift.validation import check_choice, check_int, check_ratio

#: Elements per block of :func:`synthetic_gradient` sharing one scale (a small layer's worth).
SCALE_BLOCK = 4096
#: Labels of the two reference measurements (parenthesised: never a registry name).
FLOOR, TOPK = "(floor)", "(torch.topk)"
INPUT_DESCRIPTION = (
    f"float32 Laplace(0, 1) values times a log-normal scale exp(N(0, 1)) per block of {SCALE_BLOCK} "
    "elements (a scale mixture: layers of different magnitudes, heavier tails than Laplace)"
)


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
        seed: seed of the synthetic gradient.
    """

    sizes: Sequence[int] = (250_000, 1_000_000)
    ratios: Sequence[float] = (0.1, 0.01, 0.001)
    compressors: Sequence[str] | None = None
    repeats: int = 5
    warmup: int = 3
    threads: int | None = None
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        self.sizes = [check_int(n, "sizes", low=1) for n in self.sizes]
        self.ratios = [check_ratio(r, "ratios") for r in self.ratios]
        self.repeats = check_int(self.repeats, "repeats", low=1)
        self.warmup = check_int(self.warmup, "warmup", low=0)
        if self.threads is not None:
            self.threads = check_int(self.threads, "threads", low=1)
        self.device = check_choice(self.device, "device", ("cpu", "cuda"))
        self.seed = check_int(self.seed, "seed", low=0)
        if self.compressors is not None:
            for name in self.compressors:
                compressor_class(name)  # unknown names fail here, before any timing


def synthetic_gradient(numel: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A heavy-tailed float32 gradient: ``x_i = s_{i // B} * L_i`` (see :data:`INPUT_DESCRIPTION`).

    ``L_i ~ Laplace(0, 1)`` (a random sign times an ``Exp(1)`` magnitude) and one
    ``s_b = exp(Z_b)``, ``Z_b ~ N(0, 1)``, per block of ``B = 4096`` elements.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(numel).exponential_(generator=generator)
    x *= torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8).mul_(2).sub_(1)
    scales = torch.randn(-(-numel // SCALE_BLOCK), generator=generator).exp_()
    x *= scales.repeat_interleave(SCALE_BLOCK)[:numel]
    return x.to(device)


def density_option(name: str) -> str | None:
    """The option that sets a compressor's density: ``"ratio"``, ``"threshold"`` or None."""
    accepted = inspect.signature(compressor_class(name).__init__).parameters
    return next((option for option in ("ratio", "threshold") if option in accepted), None)


def benchmarkable(names: Sequence[str] | None, device: str) -> tuple[list[str], dict[str, str]]:
    """Split ``names`` (default: the registry) into those that compress a flat tensor and the rest.

    A compressor is skipped, with the reason, when its module does not import, when
    it needs the model's parameters (``needs_parameters``), or when a probe
    ``compress`` of a small tensor raises a gradsift error (e.g. hook-only methods).
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
            get_compressor(name, **({} if option is None else {option: 0.5})).compress(
                torch.randn(64, device=device)
            )
        except GradsiftError as error:
            skipped[name] = str(error)
            continue
        usable.append(name)
    return usable, skipped


def _synchronizer(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


@dataclass
class _Method:
    """One timed method of a group: ``run()`` returns a payload (or a tensor for baselines)."""

    label: str
    run: Callable[[], Any]
    decompress: Callable[[Any], torch.Tensor] | None = None


def _group_methods(
    x: torch.Tensor, ratio: float | None, names: Sequence[str]
) -> tuple[list[_Method], dict[str, Compressor]]:
    """The floor, (for a ratio) bare top-k, and a fresh instance of each compressor."""
    numel = x.numel()
    methods = [_Method(FLOOR, lambda: torch.linalg.vector_norm(x, 1))]
    compressors: dict[str, Compressor] = {}
    if ratio is not None:
        k = target_count(numel, ratio)
        methods.append(_Method(TOPK, lambda: torch.topk(x.abs(), k, sorted=False)))
        oracle_eta = float(torch.topk(x.abs(), k, sorted=False).values.min())
    for name in names:
        option = density_option(name)
        if (option is None) != (ratio is None):
            continue
        options = {} if option is None else {option: oracle_eta if option == "threshold" else ratio}
        compressor = get_compressor(name, **options)
        compressors[name] = compressor
        methods.append(
            _Method(
                name,
                lambda c=compressor: c.compress(x, key=0),
                lambda p, c=compressor: c.decompress([p], numel),
            )
        )
    return methods, compressors


def _measure_group(
    methods: Sequence[_Method], config: CompressBenchConfig, progress: tqdm
) -> dict[str, dict[str, list]]:
    """Warm up each method, then time ``repeats`` interleaved rounds; raw samples per label."""
    sync = _synchronizer(config.device)
    samples = {m.label: {"compress": [], "decompress": [], "count": [], "nbytes": []} for m in methods}

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
            progress.update(1)
    for _ in range(config.repeats):
        for method in methods:
            out, ms = timed(method.run)
            record = samples[method.label]
            record["compress"].append(ms)
            if method.decompress is not None:
                record["decompress"].append(timed(lambda m=method, p=out: m.decompress(p))[1])
                record["count"].append(out.count)
                record["nbytes"].append(out.nbytes)
            del out
            progress.update(1)
    return samples


def _row(
    name: str,
    compressor: Compressor,
    x: torch.Tensor,
    ratio: float | None,
    samples: dict[str, dict[str, list]],
) -> dict[str, Any]:
    """One result row: medians, achieved vs target count, ratios to the floor and to top-k."""
    numel = x.numel()
    own = samples[name]
    compress_ms = statistics.median(own["compress"])
    floor_ms = statistics.median(samples[FLOOR]["compress"])
    topk_ms = statistics.median(samples[TOPK]["compress"]) if TOPK in samples else None
    target = target_count(numel, ratio) if ratio is not None else numel
    count = statistics.mean(own["count"])
    return {
        "compressor": name,
        "options": compressor.options(),
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
        "nbytes": statistics.mean(own["nbytes"]),
        "dense_nbytes": numel * x.element_size(),
    }


def run_compress_benchmark(config: CompressBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns ``{"config", "input", "environment", "skipped", "rows"}``.

    Each row: ``compressor``, ``options``, ``numel``, ``ratio`` (None for ratio-less
    compressors), ``target_count`` (``k``; ``numel`` without a ratio), ``count`` (mean
    achieved), ``count_vs_target``, medians ``compress_ms``, ``decompress_ms``,
    ``floor_ms``, ``topk_ms`` (None without a ratio), ``compress_vs_floor``,
    ``speedup_vs_topk`` (``topk_ms / compress_ms``), ``nbytes`` (mean payload bytes)
    and ``dense_nbytes`` (fp32, ``4 n``).
    """
    names, skipped = benchmarkable(config.compressors, config.device)
    load_before = os.getloadavg()[0]
    ratio_less = sum(density_option(name) is None for name in names)
    with_ratio = len(names) - ratio_less
    # (ratio, methods timed): the floor, bare top-k when there is a ratio, the group's compressors.
    groups: list[tuple[float | None, int]] = (
        [(r, with_ratio + 2) for r in config.ratios] if with_ratio else []
    )
    if ratio_less:
        groups.append((None, ratio_less + 1))
    total = sum(size for _, size in groups) * len(config.sizes) * (config.warmup + config.repeats)
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    rows = []
    try:
        with tqdm(total=total, desc="bench compress", unit="call", disable=not progress) as bar:
            for numel in config.sizes:
                x = synthetic_gradient(numel, config.seed, config.device)
                for ratio, _ in groups:
                    bar.set_postfix(numel=numel, ratio=ratio)
                    methods, compressors = _group_methods(x, ratio, names)
                    samples = _measure_group(methods, config, bar)
                    rows.extend(_row(n, c, x, ratio, samples) for n, c in compressors.items())
                del x
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "config": {**asdict(config), "compressors": names},
        "input": INPUT_DESCRIPTION,
        "environment": {
            "gradsift": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": config.threads or previous_threads,
            # Other processes on the machine inflate medians: the 1-minute load average around the run.
            "load_average": [load_before, os.getloadavg()[0]],
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
            _fmt(row["speedup_vs_topk"], ".2f"), f"{row['nbytes'] / 1e6:.3f}",
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
