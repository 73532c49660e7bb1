"""Subcommands of the ``gradsift`` command line, one module each."""
