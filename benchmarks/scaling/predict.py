"""Predicted communication time of every exchange for 64-1024 workers at 1/10/100 Gbit/s,
the crossover table against dense fp32 at ratio 1 %, and the plot.

Scenario (change with the flags): a 25.6M-parameter model (ResNet-50's size) in fp32,
density 0.01 (k = 256 000 entries of fp32 value + int32 index), 10 us per message,
compression time left out (the tables compare the wire only). PowerSGD: the same
elements as 2048 x 2048 matrices at rank 10 (0.98 % of the elements on the wire).
The traffic comes from gradsift.exchanges.costmodel (its docstring has the formulas), the
crossovers from gradsift.tools.predictions. When
``analysis.json`` (analyze.py, the measured runs) holds the balanced exchange's traffic
at 16 workers in units of ``k (P-1)/P`` entries, one more line predicts the balanced
exchange at that measured traffic (its measured slice imbalance and headers included).

    python benchmarks/scaling/predict.py    # results/scaling/predictions.json, plots/predicted_scaling.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradsift.exchanges.costmodel import (
    Traffic,
    allgather_traffic,
    dense_allreduce_traffic,
    powersgd_traffic,
    shared_mask_traffic,
    sparse_reduce_scatter_traffic,
)
from gradsift.tools.predictions import crossover_workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

RESULTS = results_dir(__file__)
BANDWIDTHS_GBIT = (1, 10, 100)
WORKERS = (64, 128, 256, 512, 1024)


def measured_balanced_units(path: Path) -> float | None:
    """The balanced exchange's measured bytes received per worker at 16 workers, in
    ``k (P-1)/P`` entries (analysis.json's target check), or None before it is measured."""
    if not path.exists():
        return None
    received = json.loads(path.read_text())["targets"]["exchanges"].get("balanced", {}).get("received")
    return None if received is None else received["in_k_entries_per_worker"]


def exchanges(
    numel: float, density: float, side: int, rank: int, balanced_units: float | None = None
) -> dict[str, Callable[[object], Traffic]]:
    """Name -> traffic of that exchange as a function of the worker count."""
    k = density * numel
    matrices = [(side, side)] * round(numel / side**2)
    measured = {}
    if balanced_units is not None:  # received = (load + kept) k (P-1)/P entries, all the excess as load
        measured[f"balanced as measured ({balanced_units:.2f} k(P-1)/P)"] = lambda p: (
            sparse_reduce_scatter_traffic(k, p, load=max(1.0, balanced_units - 1), kept=1)
        )
    return {
        "dense fp32 allreduce": lambda p: dense_allreduce_traffic(numel, p),
        "dense bf16 allreduce": lambda p: dense_allreduce_traffic(numel, p, value_bytes=2),
        "allgather": lambda p: allgather_traffic(k, p),
        "balanced (reduce-scatter + allgather)": lambda p: sparse_reduce_scatter_traffic(k, p),
        "balanced, 4k(P-1)/P bound": lambda p: sparse_reduce_scatter_traffic(k, p, load=2, kept=2),
        **measured,
        "shared-mask": lambda p: shared_mask_traffic(k, p),
        f"PowerSGD rank {rank}": lambda p: powersgd_traffic(matrices, rank, p),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=float, default=25.6e6)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--latency", type=float, default=10e-6, help="seconds per message (default 10 us)")
    parser.add_argument("--side", type=int, default=2048, help="PowerSGD matrix side")
    parser.add_argument("--rank", type=int, default=10, help="PowerSGD rank")
    parser.add_argument("--json", type=Path, default=RESULTS / "predictions.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "plots" / "predicted_scaling.png")
    parser.add_argument(
        "--analysis", type=Path, default=RESULTS / "analysis.json", help="measured runs (analyze.py)"
    )
    args = parser.parse_args(argv)
    stamp = provenance.start()
    balanced_units = measured_balanced_units(args.analysis)
    models = exchanges(args.numel, args.density, args.side, args.rank, balanced_units)
    workers = np.array(WORKERS)
    result = {
        "scenario": {"numel": args.numel, "density": args.density, "latency_s": args.latency,
                     "powersgd": {"matrix_side": args.side, "rank": args.rank}, "compress_seconds": 0.0,
                     "balanced_measured_k_entries": balanced_units},
        "workers": list(WORKERS), "predictions": {}, "crossover_vs_dense_fp32": {},
    }  # fmt: skip
    dense = models["dense fp32 allreduce"]
    for gbit in BANDWIDTHS_GBIT:
        bandwidth = gbit * 1e9 / 8
        per_exchange = {}
        for name, traffic in models.items():
            t = traffic(workers)
            per_exchange[name] = {
                "seconds": np.broadcast_to(t.seconds(bandwidth, args.latency), workers.shape).tolist(),
                "received_bytes": np.broadcast_to(t.received_bytes, workers.shape).tolist(),
            }
        result["predictions"][f"{gbit}gbit"] = per_exchange
        result["crossover_vs_dense_fp32"][f"{gbit}gbit"] = {
            name: crossover_workers(traffic, dense, bandwidth=bandwidth, latency=args.latency)
            for name, traffic in models.items()
            if traffic is not dense
        }
    result["provenance"] = stamp.finish()
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(times_table(result))
    print()
    print(crossover_table(result))
    plot(models, args.latency, args.plot)
    return 0


def times_table(result: dict) -> str:
    """Markdown: predicted communication per step (ms) per exchange, bandwidth and worker count."""
    bands = list(result["predictions"])
    header = [f"{band} P={p}" for band in bands for p in result["workers"]]
    lines = ["| exchange | " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(header)]
    for name in result["predictions"][bands[0]]:
        cells = [f"{s * 1e3:.1f}" for band in bands for s in result["predictions"][band][name]["seconds"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover_table(result: dict) -> str:
    """Markdown: per exchange, the worker count from which it stops paying against fp32."""
    bands = list(result["crossover_vs_dense_fp32"])
    lines = ["| exchange | " + " | ".join(bands) + " |", "| --- |" + " ---: |" * len(bands)]
    for name in result["crossover_vs_dense_fp32"][bands[0]]:
        cells = []
        for band in bands:
            value = result["crossover_vs_dense_fp32"][band][name]
            cells.append("never (still pays at 2^20)" if value is None else str(value))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(models: dict[str, Callable[[object], Traffic]], latency: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = np.unique(np.geomspace(2, 2048, 200).astype(int))
    figure, axes = plt.subplots(1, len(BANDWIDTHS_GBIT), figsize=(15, 4.6), sharey=True)
    for axis, gbit in zip(axes, BANDWIDTHS_GBIT, strict=True):
        for name, traffic in models.items():
            seconds = np.broadcast_to(traffic(workers).seconds(gbit * 1e9 / 8, latency), workers.shape)
            axis.plot(workers, seconds * 1e3, label=name, linestyle="--" if "bound" in name else "-")
        axis.axvspan(64, 1024, color="0.93")
        axis.set(
            xscale="log",
            yscale="log",
            xlabel="workers",
            title=f"{gbit} Gbit/s, {latency * 1e6:.0f} us/message",
        )
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted communication per step (ms)")
    axes[-1].legend(fontsize=8, loc="upper left")
    figure.suptitle("gradsift.exchanges.costmodel: 25.6M fp32 parameters, density 1 %", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
