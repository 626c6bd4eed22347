"""The cotangent tie: the one rule that keeps a checkpoint's recomputation where it belongs.

In straight-line code (unrolled layers, a scan of length one, which XLA flattens) the
recomputed forward of a checkpoint has the same inputs as the original forward, so XLA may merge
the two or run the recomputation early, and the checkpoint then saves nothing
(docs/xla-notes.md has the measurements). :func:`tie_to_cotangent` makes every value the
recomputation starts from depend on the checkpoint's incoming cotangent, so the recomputation
can run only in that checkpoint's backward step.

The rule lives in :func:`needs_tie` alone: a checkpoint is tied when it runs as straight-line
code, outside any ``lax.scan`` or in a scan of one step (which XLA flattens); in a scan of more
steps each iteration is its own computation and it stays untied. Every layout jremat builds
(:mod:`jremat._apply.layers`: layers, layer groups, nested groups, head chunks) asks :func:`needs_tie`
and passes the answer as ``prevent_cse`` (JAX's own meaning of the flag: the checkpoint may sit
in straight-line code); :meth:`jremat.Policy.wrap` ties a checkpoint built with
``prevent_cse=True`` when it recomputes anything.

The tie multiplies each saved floating-point value by ``1 + 0 * isnan(c)``, where ``c`` sums
one element of each output cotangent: that factor is exactly ``1.0`` whatever ``c`` is, so values (signed
zeros, infinities and NaNs included) are unchanged bit for bit, yet XLA cannot fold it away
(float ``0 * x`` is not simplified). Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``,
``jax.hessian``'s outer pass, ``jax.linearize``) recomputes nothing, so there the checkpoint
runs untied; so does a backward pass run eagerly (a ``jax.vjp`` pullback called outside any
``jit``, nothing traced): no compiler sees it whole, and the tie's ops would each compile on the
pullback's first call, where ``jax.checkpoint``'s compiles nothing more (JAX's issue 9661).

On a mesh the element ``c`` reads lives on one device, so XLA's SPMD partitioner broadcasts it:
each tied checkpoint costs one 4-byte all-reduce in its backward step (no SPMD-expressible scalar
depends on the cotangent without one; docs/sharding.md has the counts). The probe is computed in
the name scope :data:`TIE_SCOPE`, so :func:`jremat.collectives_report` tells these all-reduces
apart from re-issued ones. ``prevent_cse=False`` builds the checkpoint untied, as
``jax.checkpoint`` with ``prevent_cse=False`` behaves: what a checkpoint in a user's own
``lax.scan`` of several steps should pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jremat._engine import jax_compat as _jax_compat

#: The name scope of the tie's probe: on a mesh, the ``op_name`` of each all-reduce the tie adds
#: contains it.
TIE_SCOPE = "jremat_cotangent_tie"


def tie_to_cotangent(fn: Callable, *, tie: bool = True, untied_when_batched: bool = False) -> Callable:
    """Make the recomputation in ``fn``'s backward pass wait for its output cotangent.

    ``fn``'s backward pass is its own ``jax.vjp`` inside a ``custom_vjp``, linearized on each
    call's own program: what its checkpoints keep is fixed per call, before any ``vmap`` around
    the call batches it (a ``custom_vjp``'s forward rule is traced unbatched). Its equations carry
    the name stacks ``fn``'s would carry without the ``custom_vjp``.

    Args:
      fn: a (usually checkpointed) function of pytrees of arrays, returning a pytree.
        It may close over values being differentiated (a shared weight).
      tie: tie the saved values to the cotangent; ``False`` keeps only the per-call ``custom_vjp``
        (a policy judged per call, :attr:`jremat.Policy.per_call`, under ``prevent_cse=False``).
      untied_when_batched: call ``fn`` as it is when a ``vmap`` batches the call before any
        differentiation sees it, so that JAX judges ``fn``'s checkpoints on the batched program as
        ``jax.checkpoint``'s would be (:attr:`jremat.Policy.reads_batched_equations`).

    Returns:
      A function with the same values and gradients as ``fn``, bit for bit; under reverse-mode
      differentiation its saved values pass through the tie described in this module's docstring.
    """

    @functools.wraps(fn)
    def tied(*args, **kwargs):
        if _jax_compat.forward_mode_active():
            return fn(*args, **kwargs)
        # custom_vjp takes neither keyword arguments nor traced values it closes over: pass
        # both as explicit inputs.
        converted, consts = jax.closure_convert(lambda a, kw: fn(*a, **kw), args, kwargs)
        if untied_when_batched and _jax_compat.batched_first((args, kwargs, consts)):
            return fn(*args, **kwargs)
        return _tied_call(converted, tuple(consts), (args, kwargs), tie)

    return tied


def _tied_call(converted: Callable, consts: tuple, args: tuple, tie: bool):
    @jax.custom_vjp
    def call(consts, args):
        return converted(*args, *consts)

    def call_fwd(consts, args):
        # jax.vjp adds a jvp( ) to the name stack of what it runs; the equations keep the caller's.
        caller_name_stack = _jax_compat.keep_name_stack()

        def primal(c, a):
            with caller_name_stack():
                return converted(*a, *c)

        return jax.vjp(primal, consts, args)

    def call_bwd(vjp_fn, cotangent):
        residuals, treedef = jax.tree.flatten(vjp_fn)
        if tie and _traced((residuals, cotangent)):
            residuals = _tied_residuals(residuals, cotangent)
        # The pullback enters transpose( ), which the caller's backward pass has entered already.
        with _jax_compat.skip_next_name_transform():
            return jax.tree.unflatten(treedef, residuals)(cotangent)

    call.defvjp(call_fwd, call_bwd)
    return call(consts, args)


def _tied_residuals(residuals: list, cotangent) -> list:
    """``residuals``, each computed after a scalar read from every floating-point cotangent."""
    # A cotangent may be a Python scalar (jax.vjp's pullback called with 1.0): no .dtype.
    float_cotangents = [
        jnp.asarray(c) for c in jax.tree.leaves(cotangent) if jnp.issubdtype(jnp.result_type(c), jnp.floating)
    ]
    if not float_cotangents:
        return residuals
    # One element of every cotangent: some may be zeros that XLA folds (an output the
    # loss does not use, such as state written back), never all of those that matter.
    # The scope names the all-reduce XLA adds on a mesh (jremat._measure.collectives reads it).
    with jax.named_scope(TIE_SCOPE):
        probe = jnp.isnan(sum(_one_element(c).astype(jnp.float32) for c in float_cotangents))
    return [_times_exact_one(r, probe) for r in residuals]


def _traced(values) -> bool:
    """Whether a leaf of ``values`` is a tracer: whether a program is being built. An eager
    pullback (``jax.vjp(f, x)[1](ct)`` outside any ``jit``) runs op by op, so no compiler sees its
    recomputation next to the forward pass, and each op of a tie would compile on its first call."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))


def _one_element(cotangent):
    """A scalar that depends on ``cotangent``: its first element; on a mesh of explicit axes, where
    a slice of a sharded dimension cannot be expressed, its minimum (a reduction over every shard)."""
    spec = getattr(getattr(jax.typeof(cotangent), "sharding", None), "spec", ())
    if any(axis is not None for axis in spec):
        return jnp.min(cotangent)
    return cotangent.reshape(-1)[0]


def _times_exact_one(value, probe):
    """``value`` exactly, but computed after the boolean ``probe``.

    Floats: ``value * (1 + 0 * probe)``. Integers: ``value + (probe >> 1)``, and booleans:
    ``value ^ (probe > 1)`` (``probe`` is 0 or 1, so both added terms are zero, which XLA does not
    know). PRNG keys: their raw bits, tied as integers. Key and integer values matter because
    random bits recomputed from an untied key would be computed once, in the forward pass, and
    kept alive until the backward pass. Values in host memory (offloaded) are returned as they are.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return value
    if getattr(jax.typeof(value), "memory_space", None) == jax.memory.Space.Host:
        # An offloaded residual: arithmetic cannot mix memory spaces, and what the backward pass
        # does with it is a copy back, not a recomputation.
        return value
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        bits = _times_exact_one(jax.random.key_data(value), probe)
        return jax.random.wrap_key_data(bits, impl=jax.random.key_impl(value))
    if jnp.issubdtype(dtype, jnp.floating):
        one = jnp.ones((), dtype) + jnp.zeros((), dtype) * probe.astype(dtype)
        return value * one
    if jnp.issubdtype(dtype, jnp.integer):
        return value + (probe.astype(dtype) >> 1)
    if dtype == jnp.bool_:
        return value ^ (probe.astype(jnp.uint8) > 1)
    return value


def needs_tie(scan_length: int | None) -> bool:
    """The tie rule: whether a checkpoint called in a ``lax.scan`` of ``scan_length`` steps is tied.

    Args:
      scan_length: the number of steps of the ``lax.scan`` whose body calls the checkpoint, or
        ``None`` when no scan does (unrolled layers, a decorated function, a plain call).

    Returns:
      ``True`` for straight-line code (``None``, or a scan of one step, which XLA flattens), where
      XLA could merge the recomputation into the forward pass; ``False`` in a longer scan. Pass it
      as ``prevent_cse`` to :meth:`jremat.Policy.wrap`.

    Raises:
      ValueError: if ``scan_length`` is not ``None`` or a positive integer.
    """
    if scan_length is None:
        return True
    if isinstance(scan_length, bool) or not isinstance(scan_length, int) or scan_length < 1:
        raise ValueError(f"scan_length must be None (no scan) or a positive number of steps, got {scan_length!r}")
    return scan_length == 1
