"""The console scripts (``jremat-ptb``, ``jremat-memory``, ``jremat-bench``, ``jremat-launch``).

Each runs its CLI module as ``python -m jremat.train.ptb`` does (``runpy``): one ``error:`` line
(code 2) when the ``[train]`` extra is not installed, SIGINT/SIGTERM handling and the argument
checks before JAX is imported, then the CLI's ``main``.
"""

from __future__ import annotations

import os
import runpy
import sys

from jremat.train import usage


def _run(cli: str, module: str) -> int:
    usage.exit_without_train_extra(cli)
    # The module runs as ``python -m`` runs it: as sys.modules["__main__"] (what type hints, pickle
    # and dataclasses look its names up in), with sys.argv[0] its file; usage lines and errors
    # still say ``jremat-ptb``. Its ``__main__`` block ends in ``sys.exit(main())``.
    usage.console_script = os.path.basename(sys.argv[0])
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def ptb() -> int:
    """``jremat-ptb``: :mod:`train.ptb`."""
    return _run("train.ptb", "jremat.train.ptb")


def memory() -> int:
    """``jremat-memory``: :mod:`train.memory`."""
    return _run("train.memory", "jremat.train.memory")


def bench() -> int:
    """``jremat-bench``: :mod:`train.bench`."""
    return _run("train.bench", "jremat.train.bench")


def launch() -> int:
    """``jremat-launch``: :mod:`train.launch` (which forwards signals to its processes itself)."""
    return _run("train.launch", "jremat.train.launch")
