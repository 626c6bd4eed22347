"""The console scripts (``jremat-ptb``, ``jremat-memory``, ``jremat-bench``, ``jremat-launch``).

Each installs the SIGINT/SIGTERM handling of :mod:`train.interrupts` before importing its CLI
(and with it JAX), as ``python -m jremat.train.ptb`` does, then runs the CLI's ``main``.
"""

from __future__ import annotations

import importlib

from jremat.train.interrupts import INTERRUPTS


def _run(module: str) -> int:
    INTERRUPTS.install()
    return importlib.import_module(module).main()


def ptb() -> int:
    """``jremat-ptb``: :mod:`train.ptb`."""
    return _run("jremat.train.ptb")


def memory() -> int:
    """``jremat-memory``: :mod:`train.memory`."""
    return _run("jremat.train.memory")


def bench() -> int:
    """``jremat-bench``: :mod:`train.bench`."""
    return _run("jremat.train.bench.cli")


def launch() -> int:
    """``jremat-launch``: :mod:`train.launch` (which forwards signals to its processes itself)."""
    return importlib.import_module("jremat.train.launch").main()
