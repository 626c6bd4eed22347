"""The one place jremat touches JAX's private modules (``jax._src``).

``jax._src`` changes without notice between JAX releases. Every private symbol jremat uses is
listed in :data:`PRIVATE_SYMBOLS` and loaded through :func:`private`, which raises
:class:`MissingJaxInternal` naming the symbol, what jremat needs it for and the running JAX
version, instead of an ``ImportError`` deep inside a policy. The test suite checks each symbol
(``tests/jremat/test_jax_compat.py``), so a JAX upgrade that removes one fails there first.

Public replacements are preferred where they exist: :func:`custom_remat` returns
``jax.custom_remat`` when JAX exports it and falls back to the private definition otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import jax

#: (module, attribute) -> what jremat uses it for. Keep in sync with the accessors below.
PRIVATE_SYMBOLS: dict[tuple[str, str], str] = {
    ("jax._src.source_info_util", "summarize"): "source lines (file:line) of equations in saved-residual reports",
    ("jax._src.source_info_util", "user_context"): "keeping user source lines on re-bound equations",
    ("jax._src.source_info_util", "current_name_stack"): "keeping name stacks on re-bound equations",
    ("jax._src.ad_checkpoint", "saved_residuals"): "listing the residuals jax.vjp keeps (tests and reports)",
    ("jax._src.source_info_util", "register_exclusion"): "attributing saved values to the user's source "
    "lines rather than to jremat's own wrappers",
    ("jax._src.ad_checkpoint", "CheckpointName"): "reading checkpoint_name tags in jaxprs traced under "
    "jax_remat3 (saved-residual reports)",
    ("jax._src.config", "remat3"): "switching between JAX's remat engines (the jax_remat3 flag)",
    ("jax._src.ad_checkpoint", "custom_remat"): "offloading residuals to host memory under jax_remat3 "
    "(used only while JAX does not export jax.custom_remat)",
    ("jax._src.core", "trace_ctx"): "telling forward-mode differentiation (jvp, linearize) from reverse "
    "mode, under which the cotangent tie (jremat.tie) cannot apply",
}


class MissingJaxInternal(ImportError):
    """A private JAX symbol jremat relies on is absent from the running JAX."""


def private(module: str, name: str) -> Any:
    """Return the private symbol ``module.name`` listed in :data:`PRIVATE_SYMBOLS`.

    Args:
      module: the ``jax._src`` module path.
      name: the attribute of that module.

    Raises:
      KeyError: if the pair is not listed in :data:`PRIVATE_SYMBOLS` (every private use is listed).
      MissingJaxInternal: if the running JAX lacks the module or the attribute.
    """
    purpose = PRIVATE_SYMBOLS[(module, name)]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise MissingJaxInternal(
            f"jremat needs JAX's private {module}.{name} for {purpose}, but JAX {jax.__version__} "
            f"does not have it ({type(err).__name__}: {err}); update jremat/_jax_compat.py for this "
            "JAX release or install a JAX version jremat supports"
        ) from err


def _optional(module: str, name: str) -> Any:
    try:
        return private(module, name)
    except MissingJaxInternal:
        return None


# Source-line helpers are optional: reports fall back to "unknown" without them.
source_summarize: Callable | None = _optional("jax._src.source_info_util", "summarize")
source_user_context: Callable | None = _optional("jax._src.source_info_util", "user_context")
source_current_name_stack: Callable | None = _optional("jax._src.source_info_util", "current_name_stack")


def exclude_from_tracebacks(path: str) -> None:
    """Make JAX skip frames of the file ``path`` when it attributes equations to source lines
    (as it skips its own files); a no-op on a JAX without that hook."""
    register = _optional("jax._src.source_info_util", "register_exclusion")
    if register is not None:
        register(path)


def remat3_tag_name(eqn) -> str | None:
    """The name of a ``checkpoint_name`` equation traced under jax_remat3, else ``None``.

    Under remat3 a tag is a ``call_hi_primitive`` equation whose ``_prim`` is JAX's private
    ``CheckpointName``; ``None`` on a JAX without it (no remat3 tags can exist there).
    """
    prim = eqn.params.get("_prim") if eqn.primitive.name == "call_hi_primitive" else None
    if prim is None:
        return None
    checkpoint_name_type = _optional("jax._src.ad_checkpoint", "CheckpointName")
    if checkpoint_name_type is None or not isinstance(prim, checkpoint_name_type):
        return None
    return prim.params["name"]


def saved_residuals(fn: Callable, *args, **kwargs) -> list:
    """``[(aval, description)]`` of every value ``jax.vjp(fn, *args)`` keeps for the backward pass.

    JAX's own (private) ``saved_residuals``, as ``jax.ad_checkpoint.print_saved_residuals`` prints it.

    Raises:
      MissingJaxInternal: if the running JAX lacks it.
    """
    return list(private("jax._src.ad_checkpoint", "saved_residuals")(fn, *args, **kwargs))


def remat3_flag_exists() -> bool:
    """Whether the running JAX has the ``jax_remat3`` flag (both remat engines present)."""
    try:
        private("jax._src.config", "remat3")
    except MissingJaxInternal:
        return False
    return True


def remat3_enabled(value: bool):
    """Context manager setting ``jax_remat3`` to ``value`` for the code inside it (thread-local).

    Raises:
      MissingJaxInternal: if the running JAX has no ``jax_remat3`` flag.
    """
    return private("jax._src.config", "remat3")(value)


def classic_remat_context():
    """Context manager under which ``jax.checkpoint`` and ``checkpoint_name`` emit the classic
    primitives (``remat2``, ``name``); a no-op on a JAX without the ``jax_remat3`` flag."""
    if not remat3_flag_exists():
        return contextlib.nullcontext()
    return remat3_enabled(False)


def forward_mode_active() -> bool:
    """Whether a forward-mode differentiation is tracing the current call.

    True under ``jax.jvp`` / ``jax.jacfwd`` / ``jax.hessian``'s outer pass (a JVP trace) and
    under ``jax.linearize`` (a linearize trace that is not building a VJP); False under
    ``jax.grad`` / ``jax.vjp`` and outside any differentiation.

    Raises:
      MissingJaxInternal: if the running JAX has no trace context.
    """
    trace = private("jax._src.core", "trace_ctx").trace
    while trace is not None:
        kind = type(trace).__name__
        if kind == "JVPTrace" or (kind == "LinearizeTrace" and not getattr(trace, "is_vjp", True)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def custom_remat() -> Callable:
    """``jax.custom_remat`` where JAX exports it, else JAX's private definition.

    Raises:
      MissingJaxInternal: if neither exists.
    """
    public = getattr(jax, "custom_remat", None)
    if public is not None:
        return public
    return private("jax._src.ad_checkpoint", "custom_remat")


__all__ = [
    "PRIVATE_SYMBOLS",
    "MissingJaxInternal",
    "classic_remat_context",
    "custom_remat",
    "exclude_from_tracebacks",
    "forward_mode_active",
    "private",
    "remat3_enabled",
    "remat3_flag_exists",
    "remat3_tag_name",
    "saved_residuals",
    "source_current_name_stack",
    "source_summarize",
    "source_user_context",
]
