"""``python -m gradsift`` runs the command line."""

import sys

from gradsift.tools.cli import main

sys.exit(main())
