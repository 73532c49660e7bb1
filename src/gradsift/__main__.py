"""``python -m gradsift`` runs the command line."""

import sys

from gradsift.tools.cli import run

sys.exit(run())
