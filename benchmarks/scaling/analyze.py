"""Measured scaling runs beside gradsift.exchanges.costmodel: calibration, error per point, plot.

Reads ``results/scaling/results/*.json`` (written by run.py). For every shaped run it builds the cost
model's :class:`~gradsift.exchanges.costmodel.Traffic` of the run's exchange, summed over DDP's
buckets of ``mlp-wide`` (1 059 850 and 803 840 elements: DDP's 1 MB first bucket and
25 MB cap), at the run's achieved density, the sparse exchanges' fixed-capacity payloads padded to
their measured padded/sent ratio (the balanced exchange's slices have room for ``SLACK``
times an even share). Then:

- the link's time: the shaped run's median step minus the localhost run's (same
  configuration, no shaping: the CPU-bound floor). The hook's ``communicate`` median is
  reported too, but it sums the buckets' intervals, which overlap (two buckets in
  flight share the link), so it is not the link's wall time;
- nominal prediction of the link's time: ``C / bw`` with bw = the shaped rate, no latency;
- calibration: least squares of the dense runs' (fp32, bf16) link times on
  ``C / bw_eff + H L_eff``; the fitted model is then validated on the runs it did not
  see (the allgather, the new exchanges), and the step predicted as the localhost step
  plus the calibrated link time;
- the NIC's received bytes per step against the model's ``R``;
- the issue's targets (fixed in ``TARGETS`` before the runs, written into the JSON
  with their inputs): at 16 workers, the best new exchange (fastest step of
  ``balanced`` and ``shared-mask``) receives at most ``4 k (P-1)/P`` entries' worth of
  bytes per worker (``k = ratio n``, 8-byte entries; the hook's count), its step is at
  least 1.5x faster than ``allgather``'s, its communicate time grows at most 1.5x from
  2 to 16 workers, and its final accuracy (equal steps) is within 0.5 point of
  ``allgather``'s.

    python benchmarks/scaling/analyze.py    # results/scaling/analysis.json, plots/measured_vs_model.png; tables

Without localhost runs (or fewer than two dense ones) there is no link time and no
calibration: the bytes are still compared with the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from gradsift.exchanges.costmodel import (
    Traffic,
    allgather_traffic,
    dense_allreduce_traffic,
    shared_mask_traffic,
    sparse_reduce_scatter_traffic,
)
from gradsift.tools.train.netem import parse_rate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

RESULTS = results_dir(__file__)
BUCKETS = (
    1_059_850,
    803_840,
)  # DDP's buckets of mlp-wide (torch.distributed._compute_bucket_assignment_by_size)
DENSE_VALUE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}
NUMEL = sum(BUCKETS)
ENTRY_BYTES = 8  # fp32 value + int32 index
NEW_EXCHANGES = ("balanced", "shared-mask")
#: The issue's targets, fixed before the runs (see the module docstring).
TARGETS = {"workers": 16, "received_entries_bound": 4.0, "step_speedup_min": 1.5,
           "communicate_growth_max": 1.5, "growth_from_workers": 2, "accuracy_gap_max": 0.005}  # fmt: skip
#: exchange name -> cost-model family (names of the hook's ``exchange=`` option)
FAMILIES = {"allreduce": "allreduce", "allgather": "allgather", "balanced": "reduce-scatter",
            "shared-mask": "shared-mask"}  # fmt: skip


def family(result: dict) -> str:
    """Which cost model a run's exchange follows."""
    if result["exchange"] is not None:
        return FAMILIES[result["exchange"]]
    return "allreduce" if result["compressor"] in DENSE_VALUE_BYTES else "allgather"


def traffic(result: dict) -> Traffic:
    """The model's traffic of one run's step, summed over the buckets."""
    workers, means = result["workers"], result["means"]
    kind = family(result)
    total = Traffic(0.0, 0.0, 0.0)
    padded = means["bytes_padded"] / means["bytes_sent"]  # fixed-capacity payloads: what the wire carries
    for numel in BUCKETS:
        k = means["density"] * numel * padded
        if kind == "allreduce":
            total += dense_allreduce_traffic(
                numel, workers, value_bytes=DENSE_VALUE_BYTES.get(result["compressor"], 4)
            )
        elif kind == "allgather":
            total += allgather_traffic(k, workers)
        elif kind == "reduce-scatter":
            total += sparse_reduce_scatter_traffic(k, workers)
        else:  # rank 0's mean over the leader cycle: as leader (1 step in P) it receives no header or indices
            step = shared_mask_traffic(k, workers)
            broadcast = shared_mask_traffic(k, workers, value_bytes=0)
            total += Traffic(
                step.received_bytes - broadcast.received_bytes / workers, step.path_bytes, step.hops
            )
    return total


def load(results: Path) -> tuple[list[dict], dict[tuple[str, int], dict]]:
    """(shaped runs, localhost runs by (label, workers))."""
    shaped, floor = [], {}
    for path in sorted(results.glob("*-w*.json")):  # not an analysis.json written beside them
        result = json.loads(path.read_text())
        if result["bandwidth"] is None:
            floor[(result["label"], result["workers"])] = result
        else:
            shaped.append(result)
    return shaped, floor


def calibrate(points: list[dict]) -> tuple[float, float]:
    """Least-squares ``(bw_eff bytes/s, L_eff s)`` of ``link = C / bw_eff + H L_eff`` on ``points``."""
    design = np.array([[float(p["model"].path_bytes), float(p["model"].hops)] for p in points])
    measured = np.array([p["link_s"] for p in points])
    (inverse_bandwidth, latency), *_ = np.linalg.lstsq(design, measured, rcond=None)
    return 1.0 / inverse_bandwidth, max(0.0, float(latency))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS / "results", help="folder of run.py's JSON")
    parser.add_argument("--json", type=Path, default=RESULTS / "analysis.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "plots" / "measured_vs_model.png")
    args = parser.parse_args(argv)
    stamp = provenance.start()
    shaped, floor = load(args.results)
    measured = []
    for point in shaped:
        point["model"] = traffic(point)
        control = floor.get((point["label"], point["workers"]))
        if control is not None:
            point["localhost_step_s"] = control["medians"]["step_s"]
            point["link_s"] = point["medians"]["step_s"] - point["localhost_step_s"]
            measured.append(point)
    dense = [p for p in measured if family(p) == "allreduce"]
    bandwidth_eff, latency_eff = calibrate(dense) if len(dense) >= 2 else (None, None)
    rows = [
        row(p, bandwidth_eff, latency_eff) for p in sorted(shaped, key=lambda p: (p["label"], p["workers"]))
    ]
    calibration = None if bandwidth_eff is None else {
        "bandwidth_bytes_per_s": bandwidth_eff, "bandwidth_mbit": bandwidth_eff * 8 / 1e6,
        "latency_per_message_s": latency_eff, "fitted_on": "link times of the dense allreduce runs"}  # fmt: skip
    analysis = {"results": str(args.results.resolve().relative_to(RESULTS)), "targets": targets(rows),
                "accuracy_at_equal_steps": accuracy_runs(RESULTS / "accuracy"),
                "calibration": calibration, "buckets": list(BUCKETS), "points": rows,
                "provenance": stamp.finish()}  # fmt: skip
    args.json.write_text(json.dumps(analysis, indent=2) + "\n")
    print(traffic_table(analysis))
    print()
    print(calibration_line(analysis["calibration"]))
    print()
    print(time_table(analysis))
    print()
    print(targets_table(analysis["targets"]))
    print()
    print(accuracy_table(analysis["accuracy_at_equal_steps"]))
    plot(rows, args.plot)
    return 0


def row(p: dict, bandwidth_eff: float | None, latency_eff: float | None) -> dict:
    """One shaped run beside its model: bytes received (hook, NIC, model) and link time."""
    calibrated = None if bandwidth_eff is None else float(p["model"].seconds(bandwidth_eff, latency_eff))
    row = {
        "label": p["label"], "workers": p["workers"], "fitted_on": family(p) == "allreduce" and "link_s" in p,
        "step_s": p["medians"]["step_s"], "hook_communicate_s": p["medians"]["communicate_s"],
        "localhost_step_s": p.get("localhost_step_s"), "link_s": p.get("link_s"),
        "predicted_link_nominal_s": float(p["model"].seconds(parse_rate(p["bandwidth"]) / 8)),
        "predicted_link_calibrated_s": calibrated,
        "model_received_bytes": float(p["model"].received_bytes),
        "hook_bytes_received": p["means"].get("bytes_received"),
        "hook_bytes_sent": p["means"]["bytes_sent"], "ratio": p["ratio"], "exchange": p["exchange"],
        "density": p["means"]["density"],
        "final_test_accuracy": p["final_test_accuracy"],
        "load_average_before": p["load_average_before"][0], "load_average_after": p["load_average_after"][0],
        "cpu_lock": p.get("cpu_lock", "/tmp/gradsift-cpu.lock"),
    }  # fmt: skip
    if row["hook_bytes_received"] is not None:
        row["hook_over_model"] = row["hook_bytes_received"] / row["model_received_bytes"]
    if "link_s" in p:
        row["link_share"] = p["link_s"] / row["step_s"]
        row["error_nominal"] = row["predicted_link_nominal_s"] / p["link_s"] - 1
        if calibrated is not None:
            row["error_calibrated"] = calibrated / p["link_s"] - 1
            row["predicted_step_s"] = p["localhost_step_s"] + calibrated
            row["error_step"] = row["predicted_step_s"] / row["step_s"] - 1
    if "nic_per_step" in p:
        row["nic_rx_bytes_mean"] = float(np.mean([h["rx_bytes"] for h in p["nic_per_step"]]))
        row["nic_over_model"] = row["nic_rx_bytes_mean"] / row["model_received_bytes"]
    return row


def _series(rows: list[dict], exchange: str) -> dict[int, dict]:
    """The sparse runs through ``exchange`` (ratio set), by worker count."""
    return {r["workers"]: r for r in rows if r["exchange"] == exchange and r["ratio"] is not None}


def targets(rows: list[dict]) -> dict:
    """Every new exchange against the issue's targets (``TARGETS``), with the numbers
    each verdict comes from; ``best`` is the new exchange with the fastest step at
    ``TARGETS["workers"]``. A target whose runs are missing is ``None``."""
    workers, start = TARGETS["workers"], TARGETS["growth_from_workers"]
    allgather = _series(rows, "allgather")
    result: dict = {"rules": TARGETS, "exchanges": {}}
    for name in NEW_EXCHANGES:
        series = _series(rows, name)
        verdicts: dict = {}
        at = series.get(workers)
        if at is not None:
            k = at["ratio"] * NUMEL
            unit = k * (workers - 1) / workers * ENTRY_BYTES
            entries = at["hook_bytes_received"] / unit
            verdicts["received"] = {"hook_bytes_received": at["hook_bytes_received"],
                                    "nic_rx_bytes": at.get("nic_rx_bytes_mean"), "k": k,
                                    "bound_bytes": TARGETS["received_entries_bound"] * unit,
                                    "in_k_entries_per_worker": entries,
                                    "met": entries <= TARGETS["received_entries_bound"]}  # fmt: skip
            if workers in allgather:
                speedup = allgather[workers]["step_s"] / at["step_s"]
                verdicts["step_speedup"] = {"allgather_step_s": allgather[workers]["step_s"],
                                            "step_s": at["step_s"], "speedup": speedup,
                                            "met": speedup >= TARGETS["step_speedup_min"]}  # fmt: skip
            if start in series:
                growth = at["hook_communicate_s"] / series[start]["hook_communicate_s"]
                verdicts["communicate_growth"] = {
                    f"communicate_s_at_{start}": series[start]["hook_communicate_s"],
                    f"communicate_s_at_{workers}": at["hook_communicate_s"], "growth": growth,
                    "link_s_growth": _ratio(at.get("link_s"), series[start].get("link_s")),
                    "met": growth <= TARGETS["communicate_growth_max"]}  # fmt: skip
        gaps = {p: series[p]["final_test_accuracy"] - allgather[p]["final_test_accuracy"]
                for p in sorted(series) if p in allgather}  # fmt: skip
        if gaps:
            verdicts["accuracy_gap"] = {"by_workers": gaps,
                                        "met": all(abs(g) <= TARGETS["accuracy_gap_max"] for g in gaps.values())}  # fmt: skip
        result["exchanges"][name] = verdicts
    timed = {n: v["step_speedup"]["step_s"] for n, v in result["exchanges"].items() if "step_speedup" in v}
    result["best"] = min(timed, key=timed.get) if timed else None
    return result


def accuracy_runs(folder: Path) -> dict:
    """run_accuracy.sh's runs: test accuracy per exchange, workers, seed and evaluated
    step, and each new exchange's gap to allgather's run of the same seed at each step
    (the target: every gap within ``TARGETS["accuracy_gap_max"]``)."""
    curves: dict = {}
    for evals in sorted(folder.glob("*-w*-s*/evals.jsonl")):
        if not (evals.parent / "summary.json").exists():
            continue  # unfinished
        exchange, workers, seed = evals.parent.name.rsplit("-", 2)
        points = {str(r["step"]): r["accuracy"] for r in map(json.loads, evals.read_text().splitlines())}
        curves.setdefault(exchange, {}).setdefault(workers[1:], {})[seed[1:]] = points
    gaps: dict = {}
    for name in NEW_EXCHANGES:
        for workers, seeds in curves.get(name, {}).items():
            for seed, points in seeds.items():
                reference = curves.get("allgather", {}).get(workers, {}).get(seed)
                if reference is not None:
                    gaps.setdefault(name, {}).setdefault(workers, {})[seed] = {
                        step: points[step] - reference[step] for step in points if step in reference
                    }
    met = {name: all(abs(g) <= TARGETS["accuracy_gap_max"] for w in by.values() for s in w.values() for g in s.values())
           for name, by in gaps.items()}  # fmt: skip
    return {"accuracy": curves, "gap_to_allgather": gaps, "met": met}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def targets_table(result: dict) -> str:
    """Markdown: one line per target and new exchange, with its numbers and verdict."""
    rules = result["rules"]
    lines = [f"best new exchange at {rules['workers']} workers: {result['best']}", "",
             "| exchange | target | measured | met |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, v in result["exchanges"].items():
        if "received" in v:
            r = v["received"]
            lines.append(f"| {name} | received <= {rules['received_entries_bound']:.0f} k(P-1)/P entries "
                         f"({r['bound_bytes'] / 1e3:.0f} kB) | {r['hook_bytes_received'] / 1e3:.0f} kB = "
                         f"{r['in_k_entries_per_worker']:.2f} k(P-1)/P | {r['met']} |")  # fmt: skip
        if "step_speedup" in v:
            r = v["step_speedup"]
            lines.append(f"| {name} | step >= {rules['step_speedup_min']}x faster than allgather | "
                         f"{r['allgather_step_s'] * 1e3:.0f} / {r['step_s'] * 1e3:.0f} ms = {r['speedup']:.2f}x "
                         f"| {r['met']} |")  # fmt: skip
        if "communicate_growth" in v:
            r = v["communicate_growth"]
            start, end = (f"communicate_s_at_{w}" for w in (rules["growth_from_workers"], rules["workers"]))
            lines.append(f"| {name} | communicate grows <= {rules['communicate_growth_max']}x "
                         f"from {rules['growth_from_workers']} to {rules['workers']} | "
                         f"{r[end] * 1e3:.0f} / {r[start] * 1e3:.0f} ms = {r['growth']:.2f}x | {r['met']} |")  # fmt: skip
        if "accuracy_gap" in v:
            gaps = ", ".join(f"P={p}: {g * 100:+.2f}" for p, g in v["accuracy_gap"]["by_workers"].items())
            lines.append(f"| {name} | accuracy within {rules['accuracy_gap_max'] * 100:.1f} point of allgather | "
                         f"{gaps} points | {v['accuracy_gap']['met']} |")  # fmt: skip
    return "\n".join(lines)


def accuracy_table(result: dict) -> str:
    """Markdown: test accuracy at each evaluated step, one line per exchange, workers and seed."""
    lines = [
        "| exchange | P | seed | step: accuracy (gap to allgather, points) |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, by_workers in result["accuracy"].items():
        for workers, seeds in by_workers.items():
            for seed, points in seeds.items():
                gaps = result["gap_to_allgather"].get(name, {}).get(workers, {}).get(seed, {})
                cells = ", ".join(f"{step}: {acc:.4f}" + (f" ({gaps[step] * 100:+.2f})" if step in gaps else "")
                                  for step, acc in points.items())  # fmt: skip
                lines.append(f"| {name} | {workers} | {seed} | {cells} |")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def traffic_table(analysis: dict) -> str:
    """Markdown: traffic per worker and step, the model's ``R`` against the hook's count and the NIC's."""
    lines = ["| series | P | sent kB | received kB: model R | hook (/R) | NIC rx (/R) | accuracy | load before/after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in analysis["points"]:
        hook = "-" if r["hook_bytes_received"] is None else (
            f"{r['hook_bytes_received'] / 1e3:.1f} ({r['hook_over_model']:.3f})")  # fmt: skip
        nic = (
            "-"
            if "nic_rx_bytes_mean" not in r
            else f"{r['nic_rx_bytes_mean'] / 1e3:.1f} ({r['nic_over_model']:.3f})"
        )
        lines.append(f"| {r['label']} | {r['workers']} | {r['hook_bytes_sent'] / 1e3:.1f} | "
                     f"{r['model_received_bytes'] / 1e3:.1f} | {hook} | {nic} | {r['final_test_accuracy']:.4f} | "
                     f"{r['load_average_before']:.1f}/{r['load_average_after']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def calibration_line(calibration: dict | None) -> str:
    """The calibrated link model's two numbers, or why there are none."""
    if calibration is None:
        return "no calibration (no localhost floors): link times not measured"
    return (f"calibration on the dense runs' link times: bw_eff = {calibration['bandwidth_mbit']:.1f} Mbit/s, "
            f"L_eff = {calibration['latency_per_message_s'] * 1e3:.2f} ms per message")  # fmt: skip


def time_table(analysis: dict) -> str:
    """Markdown: the step, its link time and the model's predictions of it, per series and worker count."""
    lines = ["| series | P | step ms | hook communicate ms | localhost step ms | link ms (share) "
             "| model nominal ms (err) | model calibrated ms (err) | predicted step ms (err) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in analysis["points"]:
        fitted = " (fit)" if r["fitted_on"] else ""
        share = "" if r.get("link_share") is None else f" ({r['link_share'] * 100:.0f}%)"
        lines.append(
            f"| {r['label']}{fitted} | {r['workers']} | {_ms(r['step_s'])} | {_ms(r['hook_communicate_s'])} | "
            f"{_ms(r['localhost_step_s'])} | {_ms(r['link_s'])}{share} | "
            f"{_ms(r['predicted_link_nominal_s'])} ({_pct(r.get('error_nominal'))}) | "
            f"{_ms(r['predicted_link_calibrated_s'])} ({_pct(r.get('error_calibrated'))}) | "
            f"{_ms(r.get('predicted_step_s'))} ({_pct(r.get('error_step'))}) |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Left: bytes received per worker and step, hook (o) against the model (x); right:
    link time (shaped minus localhost step) against the calibrated model, when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (traffic_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.6))
    for label in sorted({r["label"] for r in rows}):
        series = sorted((r for r in rows if r["label"] == label), key=lambda r: r["workers"])
        workers = [r["workers"] for r in series]
        hooked = [r for r in series if r["hook_bytes_received"] is not None]
        line = traffic_axis.plot([r["workers"] for r in hooked], [r["hook_bytes_received"] / 1e3 for r in hooked],
                                 "o-", label=f"{label} measured (hook)")[0]  # fmt: skip
        traffic_axis.plot(workers, [r["model_received_bytes"] / 1e3 for r in series], "x--",
                          color=line.get_color(), label=f"{label} model R")  # fmt: skip
        timed = [r for r in series if r["link_s"] is not None and r["link_s"] > 0]
        if timed:
            line = time_axis.plot([r["workers"] for r in timed], [r["link_s"] * 1e3 for r in timed], "o-",
                                  label=f"{label} measured")[0]  # fmt: skip
            calibrated = [r for r in series if r["predicted_link_calibrated_s"] is not None]
            time_axis.plot([r["workers"] for r in calibrated], [r["predicted_link_calibrated_s"] * 1e3 for r in calibrated],
                           "x--", color=line.get_color(), label=f"{label} model")  # fmt: skip
    traffic_axis.set(yscale="log", ylabel="bytes received per worker and step (kB)",
                     title="mlp-wide at 100 Mbit/s: hook's count vs cost model")  # fmt: skip
    timed_any = any(r["link_s"] is not None for r in rows)
    time_axis.set(yscale="log", ylabel="link time per step (ms)",
                  title="step minus localhost step vs calibrated model" + ("" if timed_any else ": no localhost runs"))  # fmt: skip
    for axis in (traffic_axis, time_axis):
        axis.set(xscale="log", xlabel="workers")
        axis.set_xticks([2, 4, 8, 16], labels=["2", "4", "8", "16"])
        axis.set_xticks([], minor=True)
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
