"""Results of the convergence protocol: results.json, plots, and the tables in the docs.

    python benchmarks/convergence/analyze.py              # results.json + plots/
    python benchmarks/convergence/analyze.py --update-docs   # also the tables (benchmarks/claims.py --write)

Every folder named here is under ``results/convergence/``. Accuracy comes from the
localhost runs (``runs/``); the time axis from step times
measured over emulated links (``timing/``): a run's training time to step ``s`` on a
link is ``sum_{i < s} t(bytes_i)``, where ``bytes_i`` is what step ``i`` of the
localhost run sent and ``t`` interpolates linearly, in bytes, between the median step
times per message size of the method's timing runs on that link (one point for methods
whose message never changes size; two for the error-feedback sparsifiers under SGD -- the
density warm-up's first density and the target --, for methods that sync every H steps
-- a local step and a sync step --, and for the Adam hook -- its compressed step and its
dense warm-up step, which is stock DDP's). The full emulated runs in ``validation/``
check that composition.

Targets are fixed before the runs: fp32's final test accuracy (mean over seeds) minus
0.5 point; for the language model, fp32's final validation loss times 1.01.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lengths
from protocol import HEADLINE, METHODS, RESULTS, RUNS, WORKLOADS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

TIMING = RESULTS / "timing"
VALIDATION = RESULTS / "validation"
PLOTS = RESULTS / "plots"
LINKS = ("100mbit", "1gbit")
ACCURACY_MARGIN = 0.005
LOSS_MARGIN = 0.01


@dataclass
class Result:
    """One finished localhost run."""

    workload: str
    method: str
    seed: int
    epochs: float
    summary: dict[str, Any]
    evals: list[dict[str, Any]]
    steps: list[dict[str, Any]]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


RUN_NAME = re.compile(r"^(?P<method>.+)-e(?P<epochs>[0-9.]+)-s(?P<seed>\d+)$")


def load_results() -> list[Result]:
    results = []
    for summary_path in sorted(RUNS.glob("*/*/summary.json")):
        match = RUN_NAME.match(summary_path.parent.name)
        steps_path = summary_path.parent / "steps.jsonl.gz"
        if match is None or not steps_path.is_file():
            continue
        results.append(Result(
            summary_path.parent.parent.name, match["method"], int(match["seed"]), float(match["epochs"]),
            json.loads(summary_path.read_text()), read_jsonl(summary_path.parent / "evals.jsonl"),
            read_jsonl(steps_path),
        ))  # fmt: skip
    return results


def is_loss_metric(workload: str) -> bool:
    return WORKLOADS[workload].model == "gpt"


def metric_name(workload: str) -> str:
    return "validation loss (nats/byte)" if is_loss_metric(workload) else "test accuracy"


def metric(workload: str, record: dict[str, Any]) -> float:
    """The workload's metric of one evaluation: test accuracy, or validation loss (LM)."""
    return record["loss"] if is_loss_metric(workload) else record["accuracy"]


def reached(workload: str, value: float, target: float) -> bool:
    return value <= target if is_loss_metric(workload) else value >= target


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


# -- the time axis ------------------------------------------------------------------------------
#: A timing run's first steps (process start, allocator warm-up) are not its step time.
TIMING_SKIP = 3
#: Fewest steps of one message size that make its median: a 40-step timing run of a method
#: that syncs every 10 steps has 4 sync steps after the skip.
MIN_SAMPLES = 3


def timing_points(workload: str, method: str, link: str) -> list[tuple[float, float]]:
    """``(bytes_padded per step, median step seconds)`` per message size of the method's
    timing runs on ``link`` (their first ``TIMING_SKIP`` steps left out). A size measured
    fewer than ``MIN_SAMPLES`` times that is stock DDP's message takes stock DDP's point:
    the Adam hook's dense warm-up steps are stock DDP's steps."""
    by_size: dict[float, list[float]] = {}
    for steps_path in sorted((TIMING / workload).glob(f"{method}-{link}*/steps.jsonl*")):
        for record in read_jsonl(steps_path)[TIMING_SKIP:]:
            by_size.setdefault(record["bytes_padded"], []).append(record["step_s"])
    points = {size: statistics.median(times) for size, times in by_size.items() if len(times) >= MIN_SAMPLES}
    if method != "none" and points:
        for size, seconds in timing_points(workload, "none", link):
            points.setdefault(size, seconds)
    return sorted(points.items())


def step_seconds(points: list[tuple[float, float]], message_bytes: float) -> float:
    """Linear interpolation in bytes between the measured points (clamped at the ends)."""
    if len(points) == 1 or message_bytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if message_bytes <= b1:
            return t0 + (t1 - t0) * (message_bytes - b0) / (b1 - b0)
    return points[-1][1]


def composed_times(result: Result, link: str) -> list[float] | None:
    """Training time on ``link`` at each evaluation of ``result`` (None without timing runs)."""
    points = timing_points(result.workload, result.method, link)
    if not points:
        return None
    elapsed, cumulative = 0.0, []
    for record in result.steps:
        elapsed += step_seconds(points, record["bytes_padded"])
        cumulative.append(elapsed)
    return [cumulative[e["step"] - 1] for e in result.evals]


# -- the tables ---------------------------------------------------------------------------------
def analyze(results: list[Result]) -> dict[str, Any]:
    out: dict[str, Any] = {"workloads": {}}
    for name, workload in WORKLOADS.items():
        protocol = [r for r in results if r.workload == name and r.epochs == workload.epochs]
        dense = [metric(name, r.evals[-1]) for r in protocol if r.method == "none"]
        if not dense:
            continue
        dense_mean, _ = mean_sd(dense)
        target = dense_mean * (1 + LOSS_MARGIN) if is_loss_metric(name) else dense_mean - ACCURACY_MARGIN
        section: dict[str, Any] = {
            "metric": metric_name(name),
            "epochs": workload.epochs, "steps": workload.steps(workload.epochs), "fp32_final_mean": dense_mean,
            "target": target, "study": study(results, name), "methods": {},
        }  # fmt: skip
        for method in METHODS:
            runs = [r for r in protocol if r.method == method]
            if runs:
                section["methods"][method] = method_row(name, runs, target)
        add_ratios(section)
        out["workloads"][name] = section
    out["lengths"] = lengths.gaps_by_length(out)
    out["validation"] = validation(results)
    out["trainer_defaults"] = trainer_defaults(results)
    return out


def trainer_defaults(results: list[Result]) -> dict[str, Any]:
    """One epoch of VGG with the trainer's defaults: each method's final accuracy against fp32's."""
    runs = {r.method: r for r in results if r.workload == "vgg-defaults"}
    if "none" not in runs:
        return {}
    dense = runs["none"].evals[-1]["accuracy"]
    return {
        method: {"seed": run.seed, "final": run.evals[-1]["accuracy"], "vs_fp32_points": 100 * (run.evals[-1]["accuracy"] - dense),
                 "within_half_point": run.evals[-1]["accuracy"] >= dense - ACCURACY_MARGIN,
                 "fewer_bytes_than_fp32": run.summary["dense_bytes_per_step"] / run.summary["bytes_sent_per_step"],
                 "recipe": run.summary.get("recipe")}
        for method, run in runs.items()
    }  # fmt: skip


def method_row(workload: str, runs: list[Result], target: float) -> dict[str, Any]:
    finals = [metric(workload, r.evals[-1]) for r in runs]
    mean, sd = mean_sd(finals)
    steps_per_epoch = WORKLOADS[workload].steps_per_epoch
    row: dict[str, Any] = {
        "seeds": [r.seed for r in runs], "finals": finals, "final_mean": mean, "final_sd": sd,
        "bytes_per_step": statistics.fmean(r.summary["bytes_sent_per_step"] for r in runs),
        "bytes_padded_per_step": statistics.fmean(r.summary["bytes_padded_per_step"] for r in runs),
        "dense_bytes_per_step": runs[0].summary["dense_bytes_per_step"],
        "options": runs[0].summary["options"], "setting": METHODS[runs[0].method].setting,
        "diverged": any(not math.isfinite(r.summary["final_loss"]) for r in runs),
    }  # fmt: skip
    alone = all(r.summary["workers"] == 1 for r in runs)  # a one-worker control sends nothing
    row["fewer_bytes_than_fp32"] = None if alone else row["dense_bytes_per_step"] / row["bytes_per_step"]
    hits = [next((i for i, e in enumerate(r.evals) if reached(workload, metric(workload, e), target)), None)
            for r in runs]  # fmt: skip
    row["epochs_to_target"] = [None if i is None else r.evals[i]["step"] / steps_per_epoch
                               for i, r in zip(hits, runs, strict=True)]  # fmt: skip
    for link in LINKS:
        times = [composed_times(r, link) for r in runs]
        if any(t is None for t in times):
            continue
        to_target = [None if i is None else t[i] for i, t in zip(hits, times, strict=True)]
        row[f"step_s_{link}"] = statistics.median(
            step_seconds(timing_points(workload, runs[0].method, link), s["bytes_padded"])
            for s in runs[0].steps
        )
        row[f"time_to_target_s_{link}"] = to_target
        row[f"time_to_target_median_s_{link}"] = median_reached(to_target)
        row[f"total_time_s_{link}"] = statistics.fmean(t[-1] for t in times)
    return row


def median_reached(values: list[float | None]) -> float | None:
    """The median over seeds of a time (or epochs) to the target, a seed that never reached
    it counting as infinitely late; None where the median itself is such a seed."""
    median = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(median) else median


def add_ratios(section: dict[str, Any]) -> None:
    """Time-to-target speed-ups against fp32 and bf16 on each link."""
    for link in LINKS:
        key = f"time_to_target_median_s_{link}"
        for baseline in ("none", "bf16"):
            base = section["methods"].get(baseline, {}).get(key)
            for row in section["methods"].values():
                if base is not None and row.get(key):
                    row[f"sooner_than_{baseline}_{link}"] = base / row[key]


def study(results: list[Result], workload: str) -> list[dict[str, Any]]:
    """fp32 at each study length (seed 0): the final metric and its best evaluation."""
    rows = []
    for length in WORKLOADS[workload].study_epochs:
        run = next((r for r in results if r.workload == workload and r.method == "none" and r.seed == 0
                    and r.epochs == length), None)  # fmt: skip
        if run is not None:
            values = [metric(workload, e) for e in run.evals]
            best = min(values) if is_loss_metric(workload) else max(values)
            rows.append({"epochs": length, "final": values[-1], "best": best, "evals": len(values)})
    return rows


def validation(results: list[Result]) -> list[dict[str, Any]]:
    """Full emulated runs against the composed time of the matching localhost run."""
    rows = []
    for summary_path in sorted(VALIDATION.glob("*/*/summary.json")):
        workload, name = summary_path.parent.parent.name, summary_path.parent.name
        method, _, link = name.rpartition("-")
        local = next((r for r in results if r.workload == workload and r.method == method and r.seed == 0
                      and r.epochs == WORKLOADS[workload].epochs), None)  # fmt: skip
        measured = json.loads(summary_path.read_text())
        composed = composed_times(local, link) if local else None
        if composed is None:
            continue
        rows.append({
            "workload": workload, "method": method, "link": link, "measured_train_time_s": measured["train_time_s"],
            "composed_train_time_s": composed[-1], "ratio": composed[-1] / measured["train_time_s"],
            "measured_final": metric(workload, measured["evals"][-1]),
        })  # fmt: skip
    return rows


# -- plots ----------------------------------------------------------------------------------------
def plot(results: list[Result], analysis: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, section in analysis["workloads"].items():
        workload = WORKLOADS[name]
        protocol = [r for r in results if r.workload == name and r.epochs == workload.epochs]
        axes_specs = [("epoch", None)] + [(link, link) for link in LINKS]
        figure, axes = plt.subplots(1, len(axes_specs), figsize=(6 * len(axes_specs), 4.8), squeeze=False)
        for ax, (label, link) in zip(axes[0], axes_specs, strict=True):
            for method in section["methods"]:
                for index, run in enumerate(r for r in protocol if r.method == method):
                    if link is None:
                        xs = [e["step"] / workload.steps_per_epoch for e in run.evals]
                    else:
                        times = composed_times(run, link)
                        if times is None:
                            continue
                        xs = times
                    color = f"C{list(section['methods']).index(method) % 10}"
                    ax.plot(xs, [metric(name, e) for e in run.evals], color=color, alpha=0.85,
                            linewidth=1.8 if method in HEADLINE else 1.0, label=method if index == 0 else None)  # fmt: skip
            ax.axhline(section["fp32_final_mean"], color="black", linewidth=0.9, label="fp32 final (parity)")
            ax.axhline(section["target"], color="black", linestyle="--", linewidth=0.9, label="target")
            ax.set(xlabel="epoch" if link is None else f"training time over emulated {link} links (s)",
                   ylabel=section["metric"], title=f"{name}: {section['metric']} vs {label}")  # fmt: skip
            if is_loss_metric(name):
                ax.set_ylim(section["fp32_final_mean"] * 0.95, section["fp32_final_mean"] * 1.5)
            else:
                ax.set_ylim(section["fp32_final_mean"] - 0.08, section["fp32_final_mean"] + 0.02)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7, ncol=2)
        figure.tight_layout()
        path = PLOTS / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    if analysis.get("lengths"):
        written.append(lengths.plot(analysis["lengths"], PLOTS / "gpt-adamw-gaps-vs-length.png"))
    return written


# -- generated markdown -------------------------------------------------------------------------
#: What a cell of a measurement no run of the table has reads like: such a column is left out.
EMPTY_CELLS = ("-", "- s", "- / -", "- / - s")
#: What a planned table without a run says instead of its rows.
NOT_RUN = "planned, not run yet"


def bytes_factor(factor: float | None) -> str:
    """``8.6x``, or ``no bytes`` for a run that sends nothing (None: one worker alone)."""
    return "no bytes" if factor is None else f"{factor:.1f}x"


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def to_target(values: list[float | None], spec: str, unit: str = "") -> str:
    """The median to the target (:func:`median_reached`) with ``(k/n)`` where only ``k`` of
    the ``n`` seeds reached it; ``not reached (k/n)`` where the median did not."""
    reached_count = sum(v is not None for v in values)
    median = median_reached(values)
    count = "" if reached_count == len(values) else f" ({reached_count}/{len(values)})"
    return f"not reached{count}" if median is None else f"{median:{spec}}{unit}{count}"


def time_to_target(row: dict[str, Any], link: str) -> str:
    """:func:`to_target` of the seconds to the target on ``link``; ``- s`` without timing runs."""
    times = row.get(f"time_to_target_s_{link}")
    return "- s" if times is None else to_target(times, ".0f", " s")


def markdown(
    analysis: dict[str, Any], workloads: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()
) -> str:
    """The tables of ``workloads`` (default: every workload but those whose name starts
    with one of ``skip``, then the trainer-defaults table); a planned workload without a
    section in ``analysis`` (no run at its protocol length) gets one line that says so."""
    lines = []
    for name, workload in WORKLOADS.items():
        if (workloads is not None and name not in workloads) or any(name.startswith(p) for p in skip):
            continue
        section = analysis["workloads"].get(name)
        if section is None:
            lines += [f"**{name}** ({workload.epochs:g} epochs, {metric_name(name)}): {NOT_RUN}", ""]
            continue
        loss = is_loss_metric(name)
        scale, unit = (1.0, "") if loss else (100.0, "%")
        lines += [
            f"**{name}** ({section['epochs']:g} epochs, {section['metric']}; target "
            f"{fmt(section['target'] * scale, '.2f')}{unit} = fp32 {'x 1.01' if loss else '- 0.5 point'})",
            "",
        ]
        header = ("method", "setting", "final (mean ± sd, seeds)", "vs fp32", "fewer bytes than fp32",
                  "epochs to target", "time to target 100 Mbit/s", "1 Gbit/s",
                  "sooner than fp32 / bf16 at 100 Mbit/s", "whole run 100 Mbit/s / 1 Gbit/s")  # fmt: skip
        rows = []
        for method, row in section["methods"].items():
            sd = (
                f" ± {row['final_sd'] * scale:{'.3f' if loss else '.2f'}}"
                if row["final_sd"] is not None
                else ""
            )
            delta = (row["final_mean"] - section["fp32_final_mean"]) * scale
            versus = (
                f"{delta:+.3f} ({100 * delta / section['fp32_final_mean']:+.1f}%)"
                if loss
                else f"{delta:+.2f} pt"
            )
            epochs_text = to_target(row["epochs_to_target"], ".2f")
            ratios = " / ".join(fmt(row.get(f"sooner_than_{b}_100mbit"), ".2f") + "x" if row.get(f"sooner_than_{b}_100mbit") else "-"
                                for b in ("none", "bf16"))  # fmt: skip
            rows.append((method, row["setting"],
                         f"{row['final_mean'] * scale:{'.3f' if loss else '.2f'}}{unit}{sd} ({len(row['seeds'])})",
                         versus, bytes_factor(row["fewer_bytes_than_fp32"]), epochs_text,
                         time_to_target(row, "100mbit"), time_to_target(row, "1gbit"), ratios,
                         " / ".join(fmt(row.get(f"total_time_s_{link}"), ".0f") for link in LINKS) + " s"))  # fmt: skip
        kept = [c for c in range(len(header)) if any(row[c] not in EMPTY_CELLS for row in rows)]
        lines.append("| " + " | ".join(header[c] for c in kept) + " |")
        lines.append("| " + " | ".join("---" if c < 2 else "---:" for c in kept) + " |")
        lines += ["| " + " | ".join(row[c] for c in kept) + " |" for row in rows]
        lines.append("")
    defaults = analysis.get("trainer_defaults")
    if workloads is None:
        title = ("**One epoch of VGG with `gradsift train`'s defaults** (constant lr 0.05, seed 3; "
                 "target: within 0.5 point of fp32)")  # fmt: skip
        if not defaults:
            lines += [f"{title}: {NOT_RUN}", ""]
        else:
            lines += [title, "", "| method | test accuracy | vs fp32 | fewer bytes than fp32 | within 0.5 point |",
                      "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
            for method, row in defaults.items():
                lines.append(f"| {method} | {100 * row['final']:.2f}% | {row['vs_fp32_points']:+.2f} pt "
                             f"| {row['fewer_bytes_than_fp32']:.1f}x | {'yes' if row['within_half_point'] else 'no'} |")  # fmt: skip
            lines.append("")
    return "\n".join(lines)


def update_docs() -> list[Path]:
    """Regenerate the docs' tables from results.json: they are blocks of the claims registry
    (``benchmarks/claims.py``), which writes every generated number in one pass."""
    import claims

    return claims.write()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--update-docs", action="store_true", help="rewrite the generated tables in the docs")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    stamp = provenance.start()
    results = load_results()
    analysis = analyze(results) | {"provenance": stamp.finish()}  # of the analysis: each run has its own
    (RESULTS / "results.json").write_text(json.dumps(analysis, indent=2) + "\n")
    text = markdown(analysis)
    print(text)
    if not args.no_plots:
        for path in plot(results, analysis):
            print(f"wrote {path}")
    if args.update_docs:
        for path in update_docs():
            print(f"updated {path}")


if __name__ == "__main__":
    main()
