"""What jremat's own built-in policies (:mod:`jremat.policies`), reference model
(:mod:`jremat.models`) and command-line tools (:mod:`jremat.train`) use from the library beyond
its public API, in one namespace (as :mod:`equinox.internal` keeps what Equinox's sibling
libraries use): no stability promise for other users. Importing it imports no JAX; the names
that need JAX load it on first use.

Without JAX:

- :func:`alias_installed`: run from a source checkout, the checkout's ``train`` is the installed
  ``jremat.train``.
- :func:`missing_modules`, :func:`train_extra_message`: whether the ``[train]`` extra is installed,
  and the error that says how to install it.
- :data:`BUILTIN_PARAMS`, :data:`DEFAULT_MIN_FLOPS_PER_BYTE`, :data:`SELECTIVE_MODULES`: the keys
  of the built-in policies, checked before JAX is imported, ``skip_cheap``'s default threshold
  and what ``selective`` may recompute.
- :func:`convert_values`: a policy's key values checked and converted by its parameters.
- :func:`as_budget`: a budget, parsed if it is text.

With JAX (loaded on first use):

- :mod:`jaxpr`: jaxpr walks and the primitive names (the one place they are spelled).
- :func:`lower_checkpoint`: a checkpoint that keeps named values, under either remat engine.
- :class:`GroupedDotsSaveable`: JAX's dots policies that keep grouped matmuls too (``dots``).
- :class:`ProgramCache`, :func:`evaluate_tagged`: traced programs by input signature, and a
  program evaluated again with chosen outputs tagged.
- :func:`parse_layer_policies`: a per-layer policy list (``"0-1:full;2-3:none"``) parsed.
"""

import importlib as _importlib

from jremat._apply.keys import BUILTIN_PARAMS as BUILTIN_PARAMS
from jremat._apply.keys import DEFAULT_MIN_FLOPS_PER_BYTE as DEFAULT_MIN_FLOPS_PER_BYTE
from jremat._apply.keys import SELECTIVE_MODULES as SELECTIVE_MODULES
from jremat._checkout import alias_installed as alias_installed
from jremat._extras import missing_modules as missing_modules
from jremat._extras import train_extra_message as train_extra_message
from jremat._spec.budget import as_budget as as_budget
from jremat._spec.text import convert_values as convert_values

#: The names that need JAX, by the module that defines them (a module itself: the empty name).
_WITH_JAX: dict[str, tuple[str, str]] = {
    "jaxpr": ("jremat._engine.jaxpr", ""),
    "lower_checkpoint": ("jremat._engine.lowering", "lower_checkpoint"),
    "GroupedDotsSaveable": ("jremat._engine.lowering", "GroupedDotsSaveable"),
    "ProgramCache": ("jremat._program.program", "ProgramCache"),
    "evaluate_tagged": ("jremat._program.program", "evaluate_tagged"),
    "parse_layer_policies": ("jremat._apply.layers", "parse_layer_policies"),
}

__all__ = sorted(
    [
        "BUILTIN_PARAMS",
        "DEFAULT_MIN_FLOPS_PER_BYTE",
        "SELECTIVE_MODULES",
        "alias_installed",
        "as_budget",
        "convert_values",
        "missing_modules",
        "train_extra_message",
        *_WITH_JAX,
    ]
)


def __getattr__(name: str):
    where = _WITH_JAX.get(name)
    if where is None:
        raise AttributeError(f"module 'jremat.internal' has no attribute {name!r}")
    from jremat import _import_jax_once

    _import_jax_once()
    module = _importlib.import_module(where[0])
    value = getattr(module, where[1]) if where[1] else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
