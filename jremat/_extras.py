"""The optional ``[train]`` extra: which of its modules are missing, found without importing them."""

from __future__ import annotations

import importlib.util

#: The command that installs the extra, as every message about it names it.
INSTALL_TRAIN_EXTRA = 'pip install "jremat[train]"'
#: The import names of the extra's third-party packages (pyproject.toml's ``train`` extra).
TRAIN_EXTRA_MODULES = ("flax", "optax", "orbax.checkpoint", "tqdm", "matplotlib", "pooch")


def missing_modules(modules: tuple[str, ...] = TRAIN_EXTRA_MODULES) -> list[str]:
    """The names in ``modules`` that cannot be imported, without importing them (only a dotted name's parents).

    Args:
      modules: import names, such as ``"flax"`` or ``"orbax.checkpoint"``.
    """
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is not installed
            found = False
        if not found:
            missing.append(name)
    return missing


def train_extra_message(what: str, missing: list[str]) -> str:
    """One line: ``what`` needs the ``[train]`` extra, which modules are missing, and the install command."""
    return (
        f"{what} needs the [train] extra (not installed: {', '.join(missing)}); install it with {INSTALL_TRAIN_EXTRA}"
    )
