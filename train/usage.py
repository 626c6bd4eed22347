"""The error type and argument parser for user mistakes, shared by every CLI (re-exported by :mod:`train.cli`).

Imports no JAX, so that ``python -m train.launch``, which only starts and watches processes,
starts none.
"""

from __future__ import annotations

import argparse

#: The exit code of every CLI for a user mistake (bad flag, bad value, missing file).
EXIT_USAGE = 2


class UsageError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits with :data:`EXIT_USAGE`."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`UsageError` (one line, :data:`EXIT_USAGE`, no usage dump)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")
