"""End-to-end training benchmark: time to accuracy over emulated 100 Mbit/s and 1 Gbit/s links.

Runs ``gradsift train`` (its parser and code path, in this process) for every configuration below into
``results/training/runs/<name>/``, then writes ``results/training/results.json`` and the plots.
Needs root + iproute2 (network namespaces, tc tbf) and the full Fashion-MNIST
(Debian's dataset-fashion-mnist). Run it under the shared benchmark lock:

    flock /tmp/gradsift-cpu.lock python benchmarks/training/run_benchmark.py

``--analyze-only`` rebuilds results.json and the plots from existing run directories;
existing runs are skipped unless ``--rerun``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradsift.core.errors import GradsiftError
from gradsift.tools.commands import train as train_command
from gradsift.tools.predictions import allgather_crossover_workers, predict_step_time
from gradsift.tools.report import comparison_rows, find_runs, plot_runs
from gradsift.tools.train.netem import parse_rate
from gradsift.tools.train.summary import time_to_accuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

RESULTS = results_dir(__file__)
RUNS = RESULTS / "runs"
DATA_DIR = "/usr/share/datasets/fashion-mnist"
COMPRESSORS = {
    "none": [],
    "bf16": [],
    "sidco-exp": ["--ratio", "0.01"],
    "topk": ["--ratio", "0.01"],
    "vgc": [],
}
COMMON = ["--model", "vgg", "--batch-size", "32", "--lr", "0.05", "--lr-warmup-steps", "20", "--seed", "0",
          "--data-dir", DATA_DIR, "--no-progress", "--timeout", "600"]  # fmt: skip
MAIN = {"workers": 4, "steps": 200, "eval_every": 25, "bandwidths": ("100mbit", "1gbit")}
CORES = 2  # the machine the committed results come from
SUPPLEMENTARY_LEVELS = (0.70, 0.75, 0.77)
SCALING = {"workers": (2, 8), "steps": 60, "bandwidth": "100mbit", "compressors": ("none", "sidco-exp")}


def plan() -> list[tuple[str, list[str]]]:
    """(run name, gradsift train arguments) of every run, main grid first."""
    runs = []
    for bandwidth in MAIN["bandwidths"]:
        for name, extra in COMPRESSORS.items():
            runs.append((f"{name}-w{MAIN['workers']}-{bandwidth}",
                         [*extra, "--workers", str(MAIN["workers"]), "--steps", str(MAIN["steps"]),
                          "--eval-every", str(MAIN["eval_every"]), "--bandwidth", bandwidth]))  # fmt: skip
    for workers in SCALING["workers"]:
        for name in SCALING["compressors"]:
            runs.append((f"{name}-w{workers}-{SCALING['bandwidth']}",
                         [*COMPRESSORS[name], "--workers", str(workers), "--steps", str(SCALING["steps"]),
                          "--bandwidth", SCALING["bandwidth"]]))  # fmt: skip
    return runs


def train_parser() -> argparse.ArgumentParser:
    """The exact parser and code path of `gradsift train`, run in this process."""
    parser = argparse.ArgumentParser(prog="gradsift")
    train_command.add_parser(parser.add_subparsers())
    return parser


def run_all(rerun: bool) -> None:
    for name, arguments in plan():
        out = RUNS / name
        if (out / "summary.json").exists() and not rerun:
            print(f"[skip] {name} (exists)")
            continue
        compressor = next(c for c in COMPRESSORS if name.startswith(c + "-"))
        command = ["train", "--compressor", compressor, *COMMON, *arguments, "--out", str(out)]
        print("[run] gradsift", " ".join(command), flush=True)
        stamp = provenance.start(seeds=[0])  # COMMON's --seed
        args = train_parser().parse_args(command)
        try:
            args.func(args)
        except GradsiftError as error:  # record it and go on with the other runs
            print(f"[failed] {name}: {error}", flush=True)
            continue
        record = stamp.finish()
        provenance.stamp_file(out / "summary.json", record)
        print(f"[done] {name} in {record['wall_s']:.0f} s", flush=True)


def analyze() -> dict:
    """Targets, ratios, scaling vs the cost model -> results.json; plots."""
    by_name = {path.name: run for path in sorted(RUNS.iterdir()) for run in find_runs([path])}
    stamp = provenance.start(seeds=[0])
    results: dict = {"setup": {"common_args": COMMON, "main": MAIN, "scaling": SCALING}, "bandwidths": {}}
    for bandwidth in MAIN["bandwidths"]:
        names = [f"{c}-w{MAIN['workers']}-{bandwidth}" for c in COMPRESSORS]
        runs = [by_name[n] for n in names if n in by_name]
        if not runs:
            continue
        dense = by_name.get(names[0])
        target = dense.summary["final_test_accuracy"] - 0.01 if dense else None
        rows = comparison_rows(runs, target)
        table = {row["compressor"]: row for row in rows}
        results["bandwidths"][bandwidth] = {
            "target_accuracy": target, "rows": rows, "ratios": _ratios(table),
            # supplementary, clearly not the target: training time to fixed lower accuracies
            "time_to_fixed_accuracy_s": {
                f"{level:.2f}": {run.summary["compressor"]: time_to_accuracy(run.evals, level) for run in runs}
                for level in SUPPLEMENTARY_LEVELS
            },
        }  # fmt: skip
        plot_runs(runs, RESULTS / "plots" / bandwidth)
    results["scaling"] = _scaling(by_name)
    _plot_scaling(results["scaling"])
    results["provenance"] = stamp.finish()  # of the analysis; each run's summary.json has its own
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(table: dict) -> dict:
    """The targets' ratios: time to accuracy of dense / bf16 over sidco-exp and vgc; topk / sidco-exp step time."""
    tta = {c: table[c]["time_to_accuracy_s"] for c in table}
    step = {c: table[c]["step_ms"] for c in table}
    return {
        "tta_none_over_sidco": _ratio(tta.get("none"), tta.get("sidco-exp")),
        "tta_bf16_over_sidco": _ratio(tta.get("bf16"), tta.get("sidco-exp")),
        "tta_none_over_vgc": _ratio(tta.get("none"), tta.get("vgc")),
        "tta_bf16_over_vgc": _ratio(tta.get("bf16"), tta.get("vgc")),
        "step_topk_over_sidco": _ratio(step.get("topk"), step.get("sidco-exp")),
        "step_none_over_sidco": _ratio(step.get("none"), step.get("sidco-exp")),
        "step_none_over_vgc": _ratio(step.get("none"), step.get("vgc")),
    }


def _scaling(by_name: dict) -> dict:
    """Measured step time at 2/4/8 workers beside the cost model's prediction.

    The prediction (gradsift.tools.predictions.predict_step_time) takes the bytes and the
    compression time of the 4-worker runs and the compute time of the 4-worker
    sidco-exp run (its compute is least hidden by communication), scaled for this
    machine: N single-threaded workers share CORES cores, so one step's compute grows
    as ``max(N, CORES) / max(4, CORES)``. ``crossover_workers`` is where the sparse
    allgather stops paying (gradsift.tools.predictions.allgather_crossover_workers).
    """
    bandwidth = SCALING["bandwidth"]
    bytes_per_s = parse_rate(bandwidth) / 8
    runs4 = {c: by_name.get(f"{c}-w{MAIN['workers']}-{bandwidth}") for c in SCALING["compressors"]}
    if not all(runs4.values()):
        return {"rows": [], "crossover_workers": None}
    dense, sparse = (runs4[c].summary for c in SCALING["compressors"])
    compute4 = sparse["compute_median_s"]
    compress = sparse["compress_median_s"] + sparse["decompress_median_s"]
    rows = []
    for workers in sorted({*SCALING["workers"], MAIN["workers"]}):
        compute = compute4 * max(workers, CORES) / max(MAIN["workers"], CORES)
        prediction = predict_step_time(
            model_nbytes=dense["dense_bytes_per_step"], message_nbytes=sparse["bytes_sent_per_step"],
            workers=workers, bandwidth=bytes_per_s, compute_seconds=compute, compress_seconds=compress,
        )  # fmt: skip
        for compressor, predicted in zip(
            SCALING["compressors"], (prediction.dense, prediction.sparse), strict=True
        ):
            run = by_name.get(f"{compressor}-w{workers}-{bandwidth}")
            rows.append({"compressor": compressor, "workers": workers, "predicted_step_s": predicted,
                         "measured_step_s": run.summary["step_time_median_s"] if run else None})  # fmt: skip
    crossover = allgather_crossover_workers(
        model_nbytes=dense["dense_bytes_per_step"], message_nbytes=sparse["bytes_sent_per_step"],
        bandwidth=bytes_per_s, compress_seconds=compress,
    )  # fmt: skip
    return {
        "rows": rows,
        "crossover_workers": crossover,
        "compute_4_workers_s": compute4,
        "compress_s": compress,
    }


def _plot_scaling(scaling: dict) -> None:
    rows = scaling["rows"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for compressor in SCALING["compressors"]:
        mine = [r for r in rows if r["compressor"] == compressor]
        measured = [(r["workers"], r["measured_step_s"]) for r in mine if r["measured_step_s"] is not None]
        predicted = [(r["workers"], r["predicted_step_s"]) for r in mine if r["predicted_step_s"] is not None]
        line = axes.plot(*zip(*measured, strict=True), marker="o", label=f"{compressor} measured")[0]
        axes.plot(
            *zip(*predicted, strict=True),
            linestyle="--",
            color=line.get_color(),
            label=f"{compressor} predicted",
        )
    axes.set(
        xlabel="workers", ylabel="median step time (s)", title=f"Scaling at {SCALING['bandwidth']} (VGG)"
    )
    axes.set_xticks(sorted({r["workers"] for r in rows}))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    (RESULTS / "plots").mkdir(exist_ok=True)
    figure.savefig(RESULTS / "plots" / "scaling.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--analyze-only", action="store_true")
    parser.add_argument("--rerun", action="store_true")
    args = parser.parse_args()
    if not args.analyze_only:
        run_all(args.rerun)
    results = analyze()
    for bandwidth, entry in results["bandwidths"].items():
        print(f"{bandwidth}: target {entry['target_accuracy']}: {json.dumps(entry['ratios'])}")
    print(json.dumps(results["scaling"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
