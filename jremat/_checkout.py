"""Running the command-line tools from a source checkout (``python -m train.ptb`` in its root).

Installed, the checkout's ``train/`` is the package ``jremat.train`` (``pyproject.toml`` maps
the folders). Run from the root, ``python -m train.ptb`` first imports ``train`` by its folder
name; :func:`alias_installed` makes that name the installed package itself, so no file is loaded
as two module objects under two names.
"""

from __future__ import annotations

import importlib
import sys

EXIT_USAGE = 2


def alias_installed(checkout_name: str) -> None:
    """Make ``sys.modules[checkout_name]`` the installed package ``jremat.<checkout_name>``.

    Args:
      checkout_name: the package's name as a checkout folder, e.g. ``"train"`` or ``"train.bench"``.

    Raises:
      SystemExit: (code 2) with a one-line message saying how to install, when the checkout is
        not installed.
    """
    installed = f"jremat.{checkout_name}"
    try:
        sys.modules[checkout_name] = importlib.import_module(installed)
    except ModuleNotFoundError as err:
        if err.name is None or not installed.startswith(err.name):
            raise
        print(
            f"error: {installed} is not installed; from the checkout's root run: pip install -e '.[train]'",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE) from None
