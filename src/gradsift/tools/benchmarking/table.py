"""The text table ``gradsift bench compress`` prints: one line per row, grouped by size and ratio."""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`~.rows.run_compress_benchmark`'s rows, grouped by size and ratio."""
    header = [
        "compressor",
        "n",
        "ratio",
        "count/k",
        "compress ms",
        "decompress ms",
        "x floor",
        "vs topk",
        "vs topk-c",
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
            _fmt(row["speedup_vs_topk"], ".2f"), _fmt(row["speedup_vs_topk_compressor"], ".2f"),
            f"{row['nbytes'] / 1e6:.3f}",
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
