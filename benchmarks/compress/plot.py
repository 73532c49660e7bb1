"""Curves of ``gradsift bench compress`` sweeps over sizes (see README.md for the commands).

Several result files (e.g. a small-size and a large-size sweep run one after the
other) are drawn as one sweep; the title gives each file's load averages.

Left: median compress time vs gradient size, one line per compressor, with the bare
``torch.topk`` and the one-read-pass floor. Right: ``topk`` (the compressor) time over
each SIDCo variant's, and the bare ``torch.topk`` over ``sidco-exp`` (dashed), vs size;
above the line at 1 SIDCo is the cheaper. One ratio per figure (``--ratio``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from gradsift.core.extras import require


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", type=Path, nargs="+", help="JSON written by gradsift bench compress --json"
    )
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args()
    matplotlib = require("matplotlib", "plot", purpose="benchmarks/compress/plot.py")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(path.read_text()) for path in args.results]
    rows = [r for result in results for r in result["rows"] if r["ratio"] == args.ratio]
    by_name: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_name[row["compressor"]].append(row)
    first = sorted(by_name["topk"], key=lambda r: r["numel"])
    fig, (times, ratios) = plt.subplots(1, 2, figsize=(13, 5))
    sizes = [r["numel"] for r in first]
    times.plot(sizes, [r["floor_ms"] for r in first], "k:", label="floor (one read pass)")
    times.plot(sizes, [r["topk_ms"] for r in first], "k--", label="bare torch.topk")
    for name, mine in by_name.items():
        mine.sort(key=lambda r: r["numel"])
        style = "-o" if name.startswith("sidco") or name == "topk" else "-"
        times.plot(
            [r["numel"] for r in mine], [r["compress_ms"] for r in mine], style, markersize=3, label=name
        )
        if name.startswith("sidco"):
            ratios.plot([r["numel"] for r in mine], [r["speedup_vs_topk_compressor"] for r in mine], "-o",
                        markersize=3, label=f"topk / {name}")  # fmt: skip
    exp = sorted(by_name["sidco-exp"], key=lambda r: r["numel"])
    ratios.plot(
        [r["numel"] for r in exp],
        [r["speedup_vs_topk"] for r in exp],
        "k--",
        label="bare torch.topk / sidco-exp",
    )
    ratios.axhline(1.0, color="red", linewidth=0.8)
    loads = [r["environment"]["load_average"] for r in results]
    load = "load " + ", ".join(f"{a['before'][0]:.0f}->{a['after'][0]:.0f}" for a in loads)
    threads = (
        f"{results[0]['environment']['threads']} threads, {results[0]['config']['processes']} process(es)"
    )
    times.set(xscale="log", yscale="log", xlabel="elements", ylabel="median compress ms",
              title=f"compress time, ratio {args.ratio} ({threads}, {load})")  # fmt: skip
    ratios.set(xscale="log", yscale="log", xlabel="elements", ylabel="time ratio (> 1: SIDCo cheaper)",
               title="top-k time / SIDCo time")  # fmt: skip
    times.legend(fontsize=7, ncol=2)
    ratios.legend(fontsize=8)
    for ax in (times, ratios):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
