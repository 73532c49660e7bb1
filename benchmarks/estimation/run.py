"""Estimation quality of the SIDCo variants on real gradients (see README.md for the command).

Input: the files of ``benchmarks/gradients/collect.py`` (``<model>-raw.pt``,
``<model>-ef.pt``: ``"<layer>@<step>" -> tensor``). For every model, layer (``flat``
and the three largest parameters), variant and ratio, one compressor instance is
called on the saved steps in order, in three settings:

* ``raw``: the minibatch gradients,
* ``ef-saved``: the compensated gradients saved in training (Top-k's build-up),
* ``ef-replay``: the raw gradients with error feedback closed around the compressor
  under test, so it meets its *own* build-up.

The first ``--skip`` calls are adaptation; the rest give achieved/target per call,
summarised by median and 10th/90th percentile. Writes JSON and a summary plot.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

from gradsift.compressors import get_compressor
from gradsift.hook.feedback import ErrorFeedback
from gradsift.tools.analysis import estimation_series, load_gradients, percentile_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

VARIANTS = ("sidco-exp", "sidco-gpareto", "sidco-gamma")
SETTINGS = {"raw": "raw", "ef-saved": "ef", "ef-replay": "raw"}  # setting -> file kind


def sequences(path: Path) -> dict[str, list[torch.Tensor]]:
    """``layer -> [tensor at step 0, 1, ...]`` from one collected file."""
    grouped: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for name, tensor in load_gradients(path).items():
        layer, step = re.fullmatch(r"(.+)@(\d+)", name).groups()
        grouped[layer].append((int(step), tensor))
    return {
        layer: [t for _, t in sorted(items, key=lambda item: item[0])] for layer, items in grouped.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gradients", type=Path, default=Path.home() / ".cache/gradsift/gradients")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.01, 0.001])
    parser.add_argument("--sample-size", type=int, default=1 << 18, help="SIDCo's sample_size option")
    parser.add_argument(
        "--no-adapt", action="store_true", help="the paper's plain fit (adapt=False), for comparison"
    )
    parser.add_argument(
        "--exact-below", type=int, default=None,
        help="SIDCo's exact_below option (default: its own); 0 puts every tensor on the statistical path",
    )  # fmt: skip
    parser.add_argument("--skip", type=int, default=3, help="adaptation calls left out of the summary")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "results.json")
    parser.add_argument("--plot", type=Path, default=results_dir(__file__) / "summary.png")
    args = parser.parse_args()
    torch.set_num_threads(2)
    stamp = provenance.start()  # no random draws: the gradients are collect.py's (seed 0)
    rows = []
    models = sorted({p.name.rsplit("-", 1)[0] for p in args.gradients.glob("*-raw.pt")})
    for model in models:
        data = {kind: sequences(args.gradients / f"{model}-{kind}.pt") for kind in ("raw", "ef")}
        for setting, kind in SETTINGS.items():
            for layer, steps in data[kind].items():
                for variant in VARIANTS:
                    for ratio in args.ratios:
                        exact = {} if args.exact_below is None else {"exact_below": args.exact_below}
                        compressor = get_compressor(
                            variant,
                            ratio=ratio,
                            sample_size=args.sample_size,
                            adapt=not args.no_adapt,
                            **exact,
                        )
                        feedback = ErrorFeedback() if setting == "ef-replay" else None
                        series = estimation_series(compressor, steps, key=layer, feedback=feedback)
                        kept = series["ratio_series"][args.skip :]
                        rows.append({
                            "model": model, "setting": setting, "layer": layer, "numel": steps[0].numel(),
                            "variant": variant, "ratio": ratio, "target": series["target"],
                            "ratio_series": series["ratio_series"], "quality": percentile_summary(kept),
                            "time_ms": series["time_ms"],
                        })  # fmt: skip
                        q = rows[-1]["quality"]
                        print(
                            f"{model:<12}{setting:<10}{layer:<34}{variant:<14}{ratio:<7g}"
                            f"median {q['median']:.3f}  p10 {q['p10']:.3f}  p90 {q['p90']:.3f}",
                            flush=True,
                        )
    medians = [r["quality"]["median"] for r in rows]
    p10s = [r["quality"]["p10"] for r in rows]
    p90s = [r["quality"]["p90"] for r in rows]
    summary = {
        "cases": len(rows),
        "median_in_0.8_1.25": sum(0.8 <= m <= 1.25 for m in medians),
        "p10_p90_in_0.5_2": sum(lo >= 0.5 and hi <= 2.0 for lo, hi in zip(p10s, p90s, strict=True)),
        "worst_median": [min(medians), max(medians)],
        "worst_p10_p90": [min(p10s), max(p90s)],
    }
    print(json.dumps(summary, indent=2))
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "summary": summary,
                "rows": rows,
                "provenance": stamp.finish(),
            },
            indent=1,
        )
    )
    plot(rows, args.plot)


def plot(rows: list[dict], path: Path) -> None:
    """Median achieved/target with 10th-90th percentile bars, one panel per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(15, 4.5), sharey=True)
    settings = list(SETTINGS)
    for ax, variant in zip(axes, VARIANTS, strict=True):
        mine = [r for r in rows if r["variant"] == variant]
        for j, row in enumerate(mine):
            q = row["quality"]
            color = f"C{settings.index(row['setting'])}"
            ax.errorbar(j, q["median"], yerr=[[q["median"] - q["p10"]], [q["p90"] - q["median"]]], fmt="o",
                        color=color, markersize=3)  # fmt: skip
        ax.axhspan(0.8, 1.25, color="green", alpha=0.1)
        ax.axhline(1.0, color="k", linewidth=0.5)
        ax.set(yscale="log", title=variant, xlabel="case (model x layer x ratio)")
    axes[0].set_ylabel("achieved / target (median, p10-p90)")
    handles = [
        plt.Line2D([], [], color=f"C{i}", marker="o", linestyle="", label=s) for i, s in enumerate(settings)
    ]
    axes[-1].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
