"""The benchmark's result: one row per compressor and group, beside the run's environment."""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from gradsift import __version__
from gradsift.compressors.base import target_count
from gradsift.tools.benchmarking.config import CompressBenchConfig
from gradsift.tools.benchmarking.contended import in_processes, pooled
from gradsift.tools.benchmarking.groups import FLOOR, TOPK, benchmarkable, measure_all
from gradsift.tools.benchmarking.synthetic import INPUT_DESCRIPTION


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
        groups = measure_all(config, names, progress=progress)
    else:
        by_process = in_processes(config.processes, functools.partial(measure_all, config, names))
        groups = [pooled(together) for together in zip(*by_process, strict=True)]
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
