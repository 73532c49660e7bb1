"""``gradsift report DIR...``: comparison table and plots of finished runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradsift.tools.commands import HelpFormatter, prepare_outputs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="tables and plots from run results",
        description="Compare runs written by `gradsift train` / `gradsift demo`: print a table (bytes per "
        "step, compression overhead, density, step time, accuracy, time to accuracy) and write PNG plots "
        "(accuracy vs time and vs bytes, density over steps, time per phase; needs gradsift[plot]).",
        formatter_class=HelpFormatter,
    )  # fmt: skip
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a run directory or a directory of runs")
    parser.add_argument(
        "--out", type=Path, help="where the PNGs go (default: DIR/report for one DIR, else ./report)"
    )
    parser.add_argument("--target", type=float,
                        help="test accuracy for time-to-accuracy (default: best fp32 'none' run minus 0.01, "
                        "else each run's --target-accuracy)")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true", help="only the table")
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write the table rows as JSON to PATH (default: none)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar over the DIRs being read")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gradsift.core.validation import check_real
    from gradsift.tools.report import comparison_rows, default_target, find_runs, format_table, plot_runs

    if args.target is not None:
        check_real(args.target, "--target", low=0.0, high=1.0)  # an accuracy, as train's --target-accuracy
    plots = (
        None
        if args.no_plots
        else args.out or (Path(args.dirs[0]) / "report" if len(args.dirs) == 1 else Path("report"))
    )
    prepare_outputs({"--out": plots}, {"--json": args.json})
    # the bar is cleared when it closes, on an error too: the error or the table starts the line
    with tqdm(args.dirs, desc="reading", unit="dir", disable=args.no_progress, leave=False) as dirs:
        runs = [run for path in dirs for run in find_runs([path])]
    target = args.target if args.target is not None else default_target(runs)
    rows = comparison_rows(runs, target)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")
    if plots is not None:
        for path in plot_runs(runs, plots):
            print(f"wrote {path}")
    return 0
