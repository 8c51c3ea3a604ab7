"""Thin command-line entry points; `python -m launch` lists them."""

import sys

from absl import app, logging


def start(argv) -> None:
    """Common start of the training launchers: no stray positional arguments, and absl logging
    at WARNING unless --verbosity is given (orbax logs every file it writes at INFO)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not any(arg.startswith(("--verbosity", "-v")) for arg in sys.argv):
        logging.set_verbosity(logging.WARNING)
