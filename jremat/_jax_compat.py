"""The one module that reads JAX internals (``jax._src``).

Every private symbol jremat relies on is imported here, each with a clear error when a JAX
release removes it, and ``tests/jremat/test_jax_compat.py`` checks each one.
"""

from __future__ import annotations


def _private(module: str, name: str):
    """Import ``name`` from the private JAX module ``module`` or explain what is missing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        import jax

        raise ImportError(
            f"jremat needs {module}.{name}, which JAX {jax.__version__} does not provide ({err}); "
            "install a JAX version jremat supports (see pyproject.toml)"
        ) from err


def forward_mode_active() -> bool:
    """Whether a forward-mode differentiation is tracing the current call.

    True under ``jax.jvp`` / ``jax.jacfwd`` / ``jax.hessian``'s outer pass (a JVP trace) and
    under ``jax.linearize`` (a linearize trace that is not building a VJP); False under
    ``jax.grad`` / ``jax.vjp`` and outside any differentiation.
    """
    trace_ctx = _private("jax._src.core", "trace_ctx")
    trace = trace_ctx.trace
    while trace is not None:
        kind = type(trace).__name__
        if kind == "JVPTrace" or (kind == "LinearizeTrace" and not getattr(trace, "is_vjp", True)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False
