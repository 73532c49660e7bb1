"""Subcommands of the ``gradsift`` command line, one module each.

Every subcommand's parser takes ``formatter_class=HelpFormatter``, so ``--help`` states
each option's default, and names the same choices for the same flag (:data:`DEVICES`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from gradsift.core.errors import InvalidOptionError

#: ``--device`` of every command that runs on a device (``gradsift.tools.train.devices.DEVICES``,
#: written here because that module loads torch; tests/tools/test_cli.py checks they agree).
DEVICES = ("auto", "cpu", "cuda")


def whole_number(text: str) -> int:
    """An argparse ``type``: an integer, also written as a float that is one (``1e6``, ``2.5e5``)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid whole number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


class HelpFormatter(argparse.HelpFormatter):
    """Help that states every option's default, as ``(default: X)`` from the parser.

    An option whose help already says ``default`` keeps its own words (defaults that
    depend on other flags are written out there); a flag that takes no value is off
    unless given.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.nargs == 0:
            shown = "off"
        elif isinstance(action.default, list | tuple):
            shown = " ".join(map(str, action.default)) or "none"
        else:
            shown = str(action.default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ExamplesHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` whose description and epilog (command examples) keep their line breaks."""


def prepare_outputs(
    directories: Mapping[str, str | Path | None], files: Mapping[str, str | Path | None]
) -> None:
    """Make the places a command writes to before it does any work: each output directory
    (``--out``, ``--plot``: keyed by its flag) and each output file's directory (``--json``),
    with their parents. A path of the wrong kind (a directory output that is a file or lies
    under one, a file output that is a directory) raises
    :class:`~gradsift.core.errors.InvalidOptionError` naming the flag before any folder is made,
    one that cannot be made (no permission, a read-only file system) when making it -- either way
    before the work, not as a traceback after a run's results are computed. ``None``: not asked for."""
    wanted = {flag: Path(path) for flag, path in directories.items() if path is not None}
    for flag, path in files.items():
        if path is None:
            continue
        if Path(path).is_dir():
            raise InvalidOptionError(f"{flag} {path} is a directory; it needs a file's path")
        wanted[flag] = Path(path).parent
    for flag, folder in wanted.items():
        blocking = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if blocking is not None and not blocking.is_dir():
            raise InvalidOptionError(f"{flag}: {blocking} exists and is not a directory")
    for flag, folder in wanted.items():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InvalidOptionError(f"{flag}: cannot create {folder} ({error.strerror})") from None
