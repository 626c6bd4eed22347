"""The error type and argument parser for user mistakes, shared by every CLI (re-exported by :mod:`train.cli`).

Imports no JAX, so that ``python -m train.launch``, which only starts and watches processes,
starts none.
"""

from __future__ import annotations

import argparse
import os
import sys

#: The exit code of every CLI for a user mistake (bad flag, bad value, missing file).
EXIT_USAGE = 2

#: The console script (``jremat-ptb``) that started this process, if one did: set by
#: :mod:`train.console` before it runs the CLI's module, during which ``sys.argv[0]`` is the
#: module's file (as under ``python -m``).
console_script: str | None = None


def program_name(module: str) -> str:
    """How the user started the CLI ``module`` (e.g. ``"train.ptb"``), for its usage line and errors.

    ``jremat-ptb`` when started by its console script, ``python -m jremat.train.ptb`` when run by
    that name, else ``python -m train.ptb`` (a checkout's root, and calls of ``main`` from Python).
    """
    script = console_script or (os.path.basename(sys.argv[0]) if sys.argv else "")
    if script.startswith("jremat-"):
        return script
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in (f"jremat.{module}", f"jremat.{module}.__main__"):
        return f"python -m jremat.{module}"
    return f"python -m {module}"


def exit_without_train_extra(module: str) -> None:
    """Exit with one ``error:`` line and :data:`EXIT_USAGE` when the ``[train]`` extra is not installed.

    Run first by every CLI entry point (before JAX, Flax or the CLI's own imports), so that a core
    install's console scripts say what to install instead of failing on their first import.

    Args:
      module: the CLI, as :func:`program_name` takes it (e.g. ``"train.ptb"``).
    """
    from jremat.internal import missing_modules, train_extra_message

    if missing := missing_modules():
        print(f"error: {train_extra_message(program_name(module), missing)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


class UsageError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits with :data:`EXIT_USAGE`."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`UsageError` (one line, :data:`EXIT_USAGE`, no usage dump)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")
