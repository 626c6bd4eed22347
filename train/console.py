"""The console scripts (``jremat-ptb``, ``jremat-memory``, ``jremat-bench``, ``jremat-launch``).

Each runs its CLI module as ``python -m jremat.train.ptb`` does (``runpy``): one ``error:`` line
(code 2) when the ``[train]`` extra is not installed, SIGINT/SIGTERM handling and the argument
checks before JAX is imported, then the CLI's ``main``.
"""

from __future__ import annotations

import runpy

from jremat.train.usage import exit_without_train_extra


def _run(cli: str, module: str) -> int:
    exit_without_train_extra(cli)
    # The module's ``__main__`` block ends in ``sys.exit(main())``; sys.argv[0] stays the script's
    # name, so usage lines and errors say ``jremat-ptb``.
    runpy.run_module(module, run_name="__main__")
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
