"""How each AdamW method's gap to fp32 moves with the run's length, per worker count.

The AdamW campaign runs the same model, data and schedule (the cosine rescaled) at 314,
1,000 and 3,000 steps, on 2 and 4 workers (``protocol.WORKLOADS``). For each method, the
gap at a length is ``100 (L_m - L_fp32) / L_fp32`` with ``L_m`` the mean final validation
loss over the method's seeds and ``L_fp32`` fp32 DDP's mean at that length (its sd is the
method's seeds' sd over ``L_fp32``; fp32's own spread is not folded in). Where a method
ran at two lengths or more, the slope is the least-squares fit of the gap against
``log2(steps)``: percentage points per doubling of the run (negative: the gap closes as
the run grows).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

#: The AdamW workloads of one worker count, shortest first.
SERIES = {
    2: ("gpt-adamw", "gpt-adamw-1k", "gpt-adamw-3k"),
    4: ("gpt-adamw-w4", "gpt-adamw-w4-1k", "gpt-adamw-w4-3k"),
}


def gaps_by_length(analysis: dict[str, Any]) -> dict[str, Any]:
    """``{workers: {"steps": [...], "methods": {method: {"gaps": [...], "sds": [...], "seeds": [...],
    "slope_per_doubling": s}}}}`` (None where a length lacks the method; no slope for a
    method run at one length only)."""
    out: dict[str, Any] = {}
    for workers, names in SERIES.items():
        sections = [analysis["workloads"].get(name) for name in names]
        present = [s for s in sections if s is not None]
        if len(present) < 2:
            continue
        methods: dict[str, Any] = {}
        for method in dict.fromkeys(m for s in present for m in s["methods"]):
            if method == "none":
                continue
            gaps, sds, seeds = [], [], []
            for section in present:
                row = section["methods"].get(method)
                fp32 = section["fp32_final_mean"]
                gaps.append(None if row is None else 100 * (row["final_mean"] - fp32) / fp32)
                sds.append(None if row is None or row["final_sd"] is None else 100 * row["final_sd"] / fp32)
                seeds.append(0 if row is None else len(row["seeds"]))
            points = [(math.log2(s["steps"]), g) for s, g in zip(present, gaps, strict=True) if g is not None]
            if points:
                methods[method] = {
                    "gaps": gaps,
                    "sds": sds,
                    "seeds": seeds,
                    "slope_per_doubling": slope(points) if len(points) >= 2 else None,
                }
        out[str(workers)] = {"steps": [s["steps"] for s in present], "methods": methods}
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``y`` on ``x``."""
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys).slope


def markdown(lengths: dict[str, Any]) -> str:
    """One table per worker count: the gap at each length and its slope."""
    lines = []
    for workers, series in lengths.items():
        steps = series["steps"]
        lines += [
            f"**{workers} workers**: gap to fp32's validation loss (mean ± sd over the method's seeds, "
            "seeds in brackets) and its change per doubling of the run",
            "",
            "| method | " + " | ".join(f"{s:,} steps" for s in steps) + " | points per doubling |",
            "| --- | " + " | ".join("---:" for _ in steps) + " | ---: |",
        ]
        for method, row in series["methods"].items():
            cells = [
                "-" if gap is None else f"{gap:+.1f}{'' if sd is None else f' ± {sd:.1f}'} % ({count})"
                for gap, sd, count in zip(row["gaps"], row["sds"], row["seeds"], strict=True)
            ]
            slope_text = "-" if row["slope_per_doubling"] is None else f"{row['slope_per_doubling']:+.1f}"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {slope_text} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(lengths: dict[str, Any], path: Path) -> Path:
    """Gap against steps (log scale), one panel per worker count, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.8), squeeze=False)
    names = list(dict.fromkeys(m for series in lengths.values() for m in series["methods"]))
    for ax, (workers, series) in zip(axes[0], lengths.items(), strict=True):
        for method, row in series["methods"].items():
            kept = [
                (s, g, sd)
                for s, g, sd in zip(series["steps"], row["gaps"], row["sds"], strict=True)
                if g is not None
            ]
            ax.errorbar([k[0] for k in kept], [k[1] for k in kept], yerr=[k[2] or 0.0 for k in kept],
                        marker="o", capsize=3, color=f"C{names.index(method) % 10}", label=method)  # fmt: skip
        ax.axhline(0.0, color="black", linewidth=0.9, label="fp32 DDP")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.9, label="target: fp32 + 1 %")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(series["steps"], [f"{s:,}" for s in series["steps"]])
        ax.set(xlabel="steps (the cosine schedule rescaled)", ylabel="gap to fp32's final validation loss (%)",
               title=f"gpt-adamw, {workers} workers: the gap with run length")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
