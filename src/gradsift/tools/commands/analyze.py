"""``gradsift analyze FILE``: distribution fits and estimation quality on saved gradients."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradsift.tools.commands import HelpFormatter, prepare_outputs

#: :data:`gradsift.tools.analysis.DEFAULT_COMPRESSORS`, written here for the help text: the
#: parser imports no back-end, which loads torch and SciPy (tests/tools/test_cli.py checks
#: that the two agree).
DEFAULT_COMPRESSORS = ("sidco-exp", "sidco-gpareto", "sidco-gamma", "topk", "dgc", "redsync", "gaussiank")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``analyze`` subcommand."""
    parser = subparsers.add_parser(
        "analyze",
        help="distribution fits + estimation quality on saved gradients",
        description=(
            "Fit exponential, generalized Pareto, gamma and normal distributions to each "
            "tensor in FILE (KS distance of each), and run each compressor CALLS times per "
            "ratio: achieved/target count per call (median, 10th/90th percentile) and time. "
            "FILE is a torch file with a tensor or a dict name -> tensor, loaded with "
            "weights_only=True (a file that would run code is refused)."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("file", metavar="FILE", help="torch file: a tensor or a dict name -> tensor")
    parser.add_argument(
        "--compressors",
        nargs="+",
        metavar="NAME",
        help=f"registry names (default: {' '.join(DEFAULT_COMPRESSORS)}, those that are installed)",
    )
    parser.add_argument(
        "--ratios", nargs="+", type=float, default=[0.01], metavar="R", help="target densities"
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=10,
        help="calls per compressor and ratio, so adaptation shows",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write every number as JSON to PATH (default: none)"
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="write histogram and Q-Q plots per tensor to DIR (needs matplotlib; default: none)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar over the tensors")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Analyze every tensor of ``args.file``; print the table, write JSON and plots on request."""
    from gradsift.core.validation import check_int, check_ratio
    from gradsift.tools.analysis import (
        analyze_tensor,
        format_table,
        load_gradients,
        plot_fits,
        usable_compressors,
    )

    ratios = [check_ratio(r, "--ratios") for r in args.ratios]
    calls = check_int(args.calls, "--calls", low=1)
    compressors, skipped = usable_compressors(args.compressors)
    prepare_outputs({"--plot": args.plot}, {"--json": args.json})
    tensors = load_gradients(args.file)
    if skipped:
        print(
            f"skipping compressors not available in this installation: {', '.join(skipped)}", file=sys.stderr
        )
    from tqdm import tqdm

    results = [
        analyze_tensor(name, tensor, compressors, ratios, calls)
        for name, tensor in tqdm(tensors.items(), desc="tensors", unit="tensor", disable=args.no_progress)
    ]
    print(format_table(results))
    if args.plot:
        for result in results:
            for path in plot_fits(result, tensors[result["name"]], args.plot):
                print(f"wrote {path}")
    if args.json:
        args.json.write_text(
            json.dumps({"file": str(args.file), "calls": calls, "tensors": results}, indent=2)
        )
        print(f"wrote {args.json}")
    return 0
