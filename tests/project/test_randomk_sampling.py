"""benchmarks/compress/randomk_sampling.py runs against random-k's sampler as the library has it.

The script times ``randperm(n)[:k]`` beside :func:`gradsift.compressors.randomk.sample_without_replacement`;
it once kept calling the sampler with an argument the sampler had dropped and failed at its
first call unseen. A tiny run must write one row per method and ratio.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compress" / "randomk_sampling.py"


def test_the_sampler_benchmark_runs_and_writes_a_row_per_method_and_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sampling.json"
    argv = [str(SCRIPT), "--numel", "4096", "--ratios", "0.1", "0.01", "--repeats", "1", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:  # the script sets the process's intra-op threads
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["rows"]
    assert [(row["method"], row["ratio"]) for row in rows] == [
        (method, ratio)
        for ratio in (0.1, 0.01)
        for method in ("randperm[:k]", "first k distinct of a uniform stream")
    ]
    assert all(row["numel"] == 4096 and row["median_ms"] > 0 for row in rows)
