"""``python -m gradsift`` runs the command line."""

import sys

from gradsift.cli import main

sys.exit(main())
