"""The ``gradsift`` command: one subcommand module per job under ``gradsift.tools.commands``.

Each module in :data:`SUBCOMMANDS` exposes ``add_parser(subparsers)``, which adds its
parser and sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from gradsift import __version__
from gradsift.core.errors import GradsiftError

SUBCOMMANDS = ("analyze", "bench", "train", "demo", "report")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="gradsift",
        description=(
            "Gradient compression for data-parallel PyTorch training: SIDCo, VGC and "
            "the baselines, measured end to end."
        ),
    )
    parser.add_argument("--version", action="version", version=f"gradsift {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"gradsift.tools.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GradsiftError as error:
        print(f"gradsift {args.command}: error: {error}", file=sys.stderr)
        return 2


def run() -> int:
    """``gradsift`` as a program (its console script and ``python -m gradsift``): :func:`main`,
    then the heap frozen (:func:`gc.freeze`), so the interpreter's exit does not walk what the
    command left alive (torch's modules, and its compiler's under torchrun: most of a short
    command's exit), as :mod:`gradsift.tools.train.worker` ends. :func:`main` alone, as a
    caller in the same process uses it, leaves the heap as it is."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(run())
