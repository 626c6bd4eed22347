"""Which remat engine ``jax.checkpoint`` uses, and the two equations jremat binds for either one.

JAX has two rematerialization engines: the classic one (``remat2``, policy callbacks) and
``jax_remat3`` (name-based policies). :func:`active_engine` says which one the current
``jax_remat3`` value selects; :func:`name_tag` and :func:`offload_function` bind a tensor name and
an offload the way that engine reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._engine.cache import BoundedCache

#: The classic engine: ``jax.checkpoint`` binds ``remat2`` and consults policy callbacks.
CLASSIC = "classic"
#: JAX's remat3 engine (``jax_remat3``): name-based policies, no callback consultation.
REMAT3 = "remat3"
ENGINES = (CLASSIC, REMAT3)

_MEMORY_SPACES = {"pinned_host": jax.memory.Space.Host, "device": jax.memory.Space.Device}
_engine_by_flag = BoundedCache(maxsize=8)


# A name tag is attributed to the user's line that tagged the value, not to this module.
_jax_compat.exclude_from_tracebacks(__file__)


def remat3_flag() -> bool | None:
    """The ``jax_remat3`` flag's value; ``None`` on a JAX without that flag."""
    try:
        return bool(jax.config.jax_remat3)  # type: ignore[attr-defined]  # a flag defined at run time
    except AttributeError:
        return None


def active_engine() -> str:
    """The engine ``jax.checkpoint`` uses under the current ``jax_remat3`` value: :data:`CLASSIC` or :data:`REMAT3`.

    Found by tracing ``jax.checkpoint(sin)`` once per value of the ``jax_remat3`` flag and
    looking at the primitive it binds (``remat2`` for the classic engine).
    """

    def probe():
        jaxpr = jax.make_jaxpr(jax.checkpoint(jax.numpy.sin))(jax.ShapeDtypeStruct((), jax.numpy.float32))
        names = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
        return CLASSIC if names & _jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES else REMAT3

    return _engine_by_flag.get(remat3_flag(), probe)


def offload_function(src: str, dst: str) -> Callable:
    """An identity function whose remat3 residual is a copy of its input in ``dst`` memory.

    Inside a remat3 checkpoint, the forward pass copies the value from ``src`` to ``dst`` memory
    and keeps that copy; the backward pass copies it back to ``src`` instead of recomputing it
    (:func:`jremat._engine.jax_compat.remat3_offload`). Elsewhere (a call that is not differentiated,
    ``vmap``, forward mode) it is the identity.

    Raises:
      ValueError: if ``src`` or ``dst`` is not a memory kind jremat can address under remat3.
    """
    for kind in (src, dst):
        if kind not in _MEMORY_SPACES:
            raise ValueError(
                f"offload under jax_remat3 moves values with jax.device_put to a jax.memory.Space; "
                f"memory kind {kind!r} has none (valid: {', '.join(sorted(_MEMORY_SPACES))})"
            )
    there, back = _MEMORY_SPACES[dst], _MEMORY_SPACES[src]
    return lambda x: _jax_compat.remat3_offload(x, back, there)


def name_tag(x, name: str):
    """``checkpoint_name(x, name)`` for the engine in use: JAX's own under the classic engine,
    :func:`jremat._engine.jax_compat.remat3_name_tag` (which also batches under ``vmap``) under remat3."""
    if active_engine() == REMAT3:
        return _jax_compat.remat3_name_tag(x, name)
    return checkpoint_name(x, name)


__all__ = ["CLASSIC", "ENGINES", "REMAT3", "active_engine", "name_tag", "offload_function", "remat3_flag"]
