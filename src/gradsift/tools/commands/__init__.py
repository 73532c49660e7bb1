"""Subcommands of the ``gradsift`` command line, one module each.

Every subcommand's parser takes ``formatter_class=HelpFormatter``, so ``--help`` states
each option's default, and names the same choices for the same flag (:data:`DEVICES`).
"""

from __future__ import annotations

import argparse

#: ``--device`` of every command that runs on a device (``gradsift.tools.train.devices.DEVICES``,
#: written here because that module loads torch; tests/tools/test_cli.py checks they agree).
DEVICES = ("auto", "cpu", "cuda")


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
