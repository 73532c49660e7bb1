"""``gradsift demo``: the main job on the embedded Fashion-MNIST subset, a few minutes on 2 CPU cores."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradsift.tools.commands import HelpFormatter, prepare_outputs

DEFAULT_OUT = "gradsift-demo"
#: Steps per method of the full and the ``--quick`` demo (``gradsift.tools.train.demo.LENGTHS``,
#: written here because that module loads torch; tests/tools/test_cli_flags.py checks they agree).
FULL_STEPS, QUICK_STEPS = 400, 8


HELP = "the main job on an embedded default, a few minutes on 2 CPU cores"
DESCRIPTION = (
    "Train the same model with fp32 dense (none), bf16, sidco-exp, topk and vgc on 2 workers "
    "and compare bytes per step, compression overhead, achieved density, step time and test accuracy. "
    "As root with iproute2 the workers talk over emulated 100 Mbit/s links; otherwise over localhost, "
    "with the cost model's predicted step times at 1 Gbit/s and 100 Mbit/s beside the measured ones. "
    "Writes OUT/demo.json (the table's numbers), one run directory per method and OUT/plots."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps per method instead of {FULL_STEPS} (a smoke test)")  # fmt: skip
    parser.add_argument(
        "--bandwidth", default="100mbit", help="emulated link rate when emulation is possible"
    )
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write demo.json's content to PATH (default: none)")  # fmt: skip
    parser.add_argument(
        "--localhost", action="store_true", help="do not emulate a network even when possible"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradsift.tools.train.demo import run_demo

    prepare_outputs({"--out": args.out}, {"--json": args.json})
    result = run_demo(args.out, quick=args.quick, bandwidth=args.bandwidth, emulate=not args.localhost,
                      progress=not args.no_progress)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
