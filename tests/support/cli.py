"""The ``gradsift`` command's parsers, as the command-line tests read them."""

from __future__ import annotations

import argparse

from gradsift.tools.cli import build_parser


def subparser(*path: str) -> argparse.ArgumentParser:
    """The parser of ``gradsift PATH...``."""
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser
