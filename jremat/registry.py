"""The one registry of rematerialization policies (the spec strings it reads: :mod:`jremat._spec.text`).

A spec is ``NAME`` or ``NAME:key=value,key=value``; list values are joined by ``+``
(``names:save=q+k+v``). Every policy name and key accepted anywhere (CLI ``--help``, errors,
docs) comes from this registry.

Most entries build a :class:`Policy` of one function. An entry registered with ``stack=True``
(``nested``) instead describes how a whole layer stack is checkpointed: its factory returns
:class:`jremat.RematConfig` field values, which only a ``RematConfig`` (or ``run_layers``, or
the train CLIs' ``--policy``) accepts (:func:`stack_fields`); :func:`resolve` refuses it.

Tests and benches that add policies use :func:`scoped`, which restores the registry on exit::

    with jremat.registry.scoped():
        jremat.register("mine", doc="...")(MyPolicy)
        ...  # "mine" resolves here
    # and is gone here

Built-in policies live in :mod:`jremat.policies`, imported by its full name on the first
lookup (never by a top-level name that a user's ``policies.py`` could shadow); no module of the
core imports it at import time. Third-party packages add policies through the
``jremat.policies`` entry-point group, or at run time with :func:`register` /
:func:`load_module`.
"""

from jremat._apply.registry import BUILTIN_MODULE as BUILTIN_MODULE
from jremat._apply.registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from jremat._apply.registry import KEEP_COLLECTIVES as KEEP_COLLECTIVES
from jremat._apply.registry import KEEP_COLLECTIVES_PARAM as KEEP_COLLECTIVES_PARAM
from jremat._apply.registry import KEEP_GATHERED as KEEP_GATHERED
from jremat._apply.registry import KEEP_GATHERED_PARAM as KEEP_GATHERED_PARAM
from jremat._apply.registry import NAME_RE as NAME_RE
from jremat._apply.registry import REQUIRED as REQUIRED
from jremat._apply.registry import UNIVERSAL_PARAMS as UNIVERSAL_PARAMS
from jremat._apply.registry import AlreadyRegisteredError as AlreadyRegisteredError
from jremat._apply.registry import Param as Param
from jremat._apply.registry import PolicyEntry as PolicyEntry
from jremat._apply.registry import ResolvedSpec as ResolvedSpec
from jremat._apply.registry import available as available
from jremat._apply.registry import canonical_spec as canonical_spec
from jremat._apply.registry import convert_values as convert_values
from jremat._apply.registry import describe as describe
from jremat._apply.registry import entries as entries
from jremat._apply.registry import load_module as load_module
from jremat._apply.registry import normalize_spec as normalize_spec
from jremat._apply.registry import parse_spec as parse_spec
from jremat._apply.registry import register as register
from jremat._apply.registry import resolve as resolve
from jremat._apply.registry import resolve_spec as resolve_spec
from jremat._apply.registry import scoped as scoped
from jremat._apply.registry import stack_error as stack_error
from jremat._apply.registry import stack_fields as stack_fields
from jremat._apply.registry import unregister as unregister
from jremat._apply.registry import value_as_text as value_as_text

__all__ = [
    "AlreadyRegisteredError",
    "available",
    "BUILTIN_MODULE",
    "canonical_spec",
    "convert_values",
    "describe",
    "entries",
    "ENTRY_POINT_GROUP",
    "KEEP_COLLECTIVES",
    "KEEP_COLLECTIVES_PARAM",
    "KEEP_GATHERED",
    "KEEP_GATHERED_PARAM",
    "load_module",
    "NAME_RE",
    "normalize_spec",
    "Param",
    "parse_spec",
    "PolicyEntry",
    "register",
    "REQUIRED",
    "resolve",
    "resolve_spec",
    "ResolvedSpec",
    "scoped",
    "stack_error",
    "stack_fields",
    "UNIVERSAL_PARAMS",
    "unregister",
    "value_as_text",
]
