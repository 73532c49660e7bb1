"""The ``gradsift`` command: one subcommand module per job under ``gradsift.tools.commands``.

Each module in :data:`SUBCOMMANDS` exposes ``add_parser(subparsers)``, which adds its
parser and sets ``func`` (called with the parsed namespace, returning an exit code).

An argument no parser knows is reported by the (sub)command it was given to, with its usage
and the closest of its options (``gradsift train: error: unrecognized arguments: --compresor
(did you mean --compressor?)``), where argparse alone reports it at the top level.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from gradsift import __version__
from gradsift.core.errors import GradsiftError
from gradsift.core.spelling import closest, did_you_mean

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
    _mark_commands(parser)
    return parser


def _mark_commands(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)command's parser the default ``command_parser``: itself (a nested
    subcommand's default wins over its parent's, so the parsed namespace names the innermost)."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _mark_commands(subparser)


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message for ``extras``, with the closest option of ``parser`` to each
    unknown flag (``--name`` or ``--name=value``) where one is close: names compared without
    their dashes (:func:`gradsift.core.spelling.closest`)."""
    options = {o.lstrip("-"): o for action in parser._actions for o in action.option_strings}
    names = [extra.split("=", 1)[0].lstrip("-") for extra in extras if extra.startswith("-")]
    hints = [options[match] for name in names if (match := closest(name, options))]
    return f"unrecognized arguments: {' '.join(extras)}{did_you_mean(hints)}"


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        args.command_parser.error(unrecognized(extras, args.command_parser))
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
