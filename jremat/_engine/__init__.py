"""The remat engine: how a checkpoint is built under either JAX remat engine.

The JAX shim (:mod:`.jax_compat`, the one place private JAX is reached), jaxpr walks and the
primitive names (:mod:`.jaxpr`), name tags (:mod:`.tags`), which engine is active
(:mod:`.active`), the interpreter that re-evaluates a traced program equation by equation
(:mod:`.interpreter`), the lowering of a checkpoint with a set of values to keep
(:mod:`.lowering`), the cotangent tie that keeps a recomputation in the backward pass
(:mod:`.tie`), and the bounded, thread-safe caches (:mod:`.cache`).

The lowering runs programs through the interpreter, and the interpreter lowers a nested
checkpoint it re-emits with the lowering: that one recursion is a call-time import in
:func:`.interpreter.bind_translated`.

Imports: :mod:`jremat._spec` only.
"""
