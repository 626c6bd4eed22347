"""The optional ``[train]`` extra: which of its modules are missing, found without importing them."""

from __future__ import annotations

import importlib.machinery
import importlib.util

#: The command that installs the extra, as every message about it names it.
INSTALL_TRAIN_EXTRA = 'pip install "jremat[train]"'
#: The import names of the extra's third-party packages (pyproject.toml's ``train`` extra).
TRAIN_EXTRA_MODULES = ("flax", "optax", "orbax.checkpoint", "tqdm", "matplotlib", "pooch")


def missing_modules(modules: tuple[str, ...] = TRAIN_EXTRA_MODULES) -> list[str]:
    """The names in ``modules`` that cannot be imported, found without importing any of them.

    Args:
      modules: import names, such as ``"flax"`` or ``"orbax.checkpoint"``.
    """
    return [name for name in modules if not _findable(name)]


def _findable(name: str) -> bool:
    # A dotted name's submodules are looked up on its parent's search path: importlib.util.find_spec
    # would import the parent package to get that path.
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def train_extra_message(what: str, missing: list[str]) -> str:
    """One line: ``what`` needs the ``[train]`` extra, which modules are missing, and the install command."""
    return (
        f"{what} needs the [train] extra (not installed: {', '.join(missing)}); install it with {INSTALL_TRAIN_EXTRA}"
    )
