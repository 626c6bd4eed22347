"""The console scripts (``jremat-ptb``, ``jremat-memory``, ``jremat-bench``, ``jremat-launch``).

Each first exits with one ``error:`` line (code 2) when the ``[train]`` extra is not installed,
then installs the SIGINT/SIGTERM handling of :mod:`train.interrupts` before importing its CLI
(and with it JAX), as ``python -m jremat.train.ptb`` does, then runs the CLI's ``main``.
"""

from __future__ import annotations

import importlib

from jremat.train.interrupts import INTERRUPTS
from jremat.train.usage import exit_without_train_extra


def _run(cli: str, module: str) -> int:
    exit_without_train_extra(cli)
    INTERRUPTS.install()
    return importlib.import_module(module).main()


def ptb() -> int:
    """``jremat-ptb``: :mod:`train.ptb`."""
    return _run("train.ptb", "jremat.train.ptb")


def memory() -> int:
    """``jremat-memory``: :mod:`train.memory`."""
    return _run("train.memory", "jremat.train.memory")


def bench() -> int:
    """``jremat-bench``: :mod:`train.bench`."""
    return _run("train.bench", "jremat.train.bench.cli")


def launch() -> int:
    """``jremat-launch``: :mod:`train.launch` (which forwards signals to its processes itself)."""
    exit_without_train_extra("train.launch")
    return importlib.import_module("jremat.train.launch").main()
