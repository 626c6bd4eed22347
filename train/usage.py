"""The error type and argument parser for user mistakes, shared by every CLI (re-exported by :mod:`train.cli`).

Imports no JAX, so that ``python -m train.launch``, which only starts and watches processes,
starts none.
"""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits with code 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`UsageError` (one line, exit 2, no usage dump)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")
