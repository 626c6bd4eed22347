"""The jaxpr interpreter: jremat's programs traced flat, and evaluated again equation by equation.

:func:`trace_flat` traces a function with the classic primitives (``name``, ``remat2``) under
either remat engine, nested ``jit`` bodies inlined, so that policies see one program;
:func:`evaluate_inlined`, :func:`evaluate_tagged` and :func:`bind_equation` evaluate such a
program again, re-emitting its name tags and checkpoints for the engine in use
(:func:`translates`, :func:`bind_translated`) and tagging the outputs a policy chose.

The lowering of checkpoints (:mod:`jremat._engine.lowering`) runs programs through this
interpreter, and the interpreter lowers a nested checkpoint it re-emits with that lowering: the
recursion is inherent. It is one call-time import, in :func:`bind_translated`; the module-level
imports go one way (lowering imports the interpreter).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
from jax.extend import core as jcore

from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._engine import tags as _tags
from jremat._engine.active import REMAT3, active_engine, name_tag, offload_function

# Equations it binds for the user's are attributed to the user's line (:func:`source_of`), any other to the caller's.
_jax_compat.exclude_from_tracebacks(__file__)

# ---------------------------------------------------------------------------------------------
# Re-emitting classic equations under remat3
# ---------------------------------------------------------------------------------------------


def translates(eqn) -> bool:
    """Whether ``eqn`` is a classic ``checkpoint_name`` / ``jax.checkpoint`` equation that must be
    re-emitted for remat3 when re-bound (true only while remat3 is active)."""
    name = eqn.primitive.name
    return (name == _jaxpr.NAME or name in _jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES) and active_engine() == REMAT3


def bind_translated(eqn, invals) -> list:
    """Re-emit a classic name tag or checkpoint equation (see :func:`translates`) for remat3.

    A ``name`` equation becomes :func:`jremat._engine.active.name_tag` (remat3's name tag); a ``remat2`` equation
    becomes :func:`jremat._engine.lowering.lower_checkpoint` of its body with the same policy, the body re-emitted the same way.

    Returns:
      The equation's outputs, as a list.
    """
    if (tag := _jaxpr.name_tag(eqn)) is not None:
        return [name_tag(invals[0], tag)]
    body = eqn.params["jaxpr"]
    consts = body.consts if hasattr(body, "consts") else ()
    body = body.jaxpr if hasattr(body, "jaxpr") else body
    policy = eqn.params.get("policy")
    fun = lambda *xs: evaluate_reemitted(body, consts, xs, {})
    # The one way back from the interpreter to the lowering (which imports this module).
    from jremat._engine.lowering import lower_checkpoint

    return list(lower_checkpoint(fun, callback=policy)(*invals))


def evaluate_reemitted(jaxpr, consts, args, offload: Mapping[str, tuple[str, str]], keep_calls: bool = False) -> list:
    """Evaluate a (classic) jaxpr, re-emitting name tags and checkpoints for the active engine
    and offloading the values tagged with the names in ``offload``; ``keep_calls``: nested calls
    with nothing to re-emit stay calls."""

    def offload_named(eqn, outs):
        if (tag := _jaxpr.name_tag(eqn)) is not None and tag in offload:
            with source_of(eqn):
                return [offload_function(*offload[tag])(outs[0])]
        return outs

    return evaluate_inlined(jaxpr, consts, args, offload_named, keep_calls=keep_calls)


def _holds_translated(jaxpr) -> bool:
    """Whether ``jaxpr`` (or one nested in it) holds a name tag or a classic checkpoint."""
    translated = {_jaxpr.NAME, *_jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES}
    return any(eqn.primitive.name in translated for eqn in _jaxpr.equations(jaxpr))


# ---------------------------------------------------------------------------------------------
# Flattened programs: tracing with nested calls inlined, and re-evaluation (tags added)
# ---------------------------------------------------------------------------------------------


def _read(env, v):
    return v.val if isinstance(v, jcore.Literal) else env[v]


@contextlib.contextmanager
def source_of(eqn) -> Iterator[None]:
    """Equations bound inside carry ``eqn``'s source line and name stack (and its context): those
    the interpreter binds for the user's equation (the equation itself, a name tag on its output)
    point at the user's line, not here."""
    if _jax_compat.source_user_context is None or _jax_compat.source_current_name_stack is None:  # pragma: no cover
        yield
        return
    name_stack = _jax_compat.source_current_name_stack() + eqn.source_info.name_stack
    with _jax_compat.source_user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def bind_equation(eqn, invals) -> list:
    """Bind ``eqn``'s primitive to ``invals`` with its source line and name stack, for the active engine.

    Returns:
      The outputs, as a list.
    """
    with source_of(eqn):
        if translates(eqn):  # a classic name tag / checkpoint re-bound under jax_remat3
            return bind_translated(eqn, invals)
        if _jaxpr.is_scan(eqn) and active_engine() == REMAT3 and _holds_translated(eqn.params["jaxpr"].jaxpr):
            return rebind_scan(eqn, invals, lambda body, args: evaluate_inlined(body.jaxpr, body.consts, args))
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


#: Whether :func:`bind_named` tags outputs where their derivative reads them (off while a
#: checkpoint is traced for remat3: :func:`remat3_tags`).
_DERIVATIVE_TAGS: contextvars.ContextVar[bool] = contextvars.ContextVar("jremat_derivative_tags", default=True)


@contextlib.contextmanager
def remat3_tags() -> Iterator[None]:
    """Inside: :func:`bind_named` tags outputs after their primitive only. remat3 runs a
    ``custom_jvp``'s primal function outside its remat trace, where a tag saves nothing."""
    token = _DERIVATIVE_TAGS.set(False)
    try:
        yield
    finally:
        _DERIVATIVE_TAGS.reset(token)


def bind_named(eqn, invals, names: Sequence[str]) -> list:
    """:func:`bind_equation` with output ``k`` tagged ``names[k]``, also where the equation's own
    derivative reads it (:data:`jremat._engine.jaxpr.OUTPUT_READING_DERIVATIVES`).

    A name tag after ``exp`` or ``top_k`` names a copy of the output that the primitive's own
    derivative (``t * exp(x)``, ``top_k``'s gather by its indices) does not read. A checkpoint that
    saves the name would then run the primitive again in the backward pass and keep its input for
    it too: a softmax's shifted scores beside its ``exp``, a whole row of router logits beside
    ``k`` indices. Here the primitive is bound inside a ``custom_jvp`` whose rule evaluates the
    primitive's own derivative with the outputs tagged where they are made: values and
    derivatives unchanged, the saved output the one read. Only under the classic engine: remat3
    records its recomputation from the tags themselves and differentiates that, so there the
    primitive runs again (docs/remat-engines.md).
    """

    def bound_then_named(args) -> list:
        with source_of(eqn):
            return [name_tag(o, n) for o, n in zip(bind_equation(eqn, args), names)]

    if eqn.primitive.name not in _jaxpr.OUTPUT_READING_DERIVATIVES or not _DERIVATIVE_TAGS.get():
        return bound_then_named(invals)

    @jax.custom_jvp
    def named(*args):
        return bound_then_named(args)

    @named.defjvp
    def named_derivative(primals, tangents):
        traced = jax.make_jaxpr(lambda p, t: jax.jvp(lambda *a: bind_equation(eqn, a), p, t))(primals, tangents)
        n_out = len(names)
        primal_outs = {v: k for k, v in enumerate(traced.jaxpr.outvars[:n_out]) if not isinstance(v, jcore.Literal)}
        env = dict(zip(traced.jaxpr.constvars, traced.consts))
        env.update(zip(traced.jaxpr.invars, [*primals, *tangents]))
        for inner in traced.jaxpr.eqns:
            outs = bind_equation(inner, [_read(env, v) for v in inner.invars])
            for v, o in zip(inner.outvars, outs):
                if v in primal_outs:
                    with source_of(eqn):
                        o = name_tag(o, names[primal_outs[v]])
                env[v] = o
        results = [_read(env, v) for v in traced.jaxpr.outvars]
        return results[:n_out], results[n_out:]

    return list(named(*invals))


def rebind_scan(eqn, invals, evaluate_body: Callable) -> list:
    """Run a ``scan`` equation with ``lax.scan``, its body evaluated by
    ``evaluate_body(closed_body, flat_body_args)`` (which may re-emit or rewrite equations).

    Returns:
      The final carries, then the stacked outputs, as a list.
    """
    n_consts, n_carry = _jax_compat.scan_counts(eqn)
    consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
    body = eqn.params["jaxpr"]

    def step(carry, x):
        outs = evaluate_body(body, [*consts, *carry, *x])
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(
        step,
        list(init),
        list(xs),
        length=eqn.params["length"],
        reverse=eqn.params["reverse"],
        unroll=eqn.params.get("unroll", 1),
    )
    return [*carry, *ys]


def rebind_shard_map(eqn, invals, evaluate_body: Callable) -> list:
    """Run a ``shard_map`` equation with :func:`jax.shard_map` on its mesh and specs, its body
    evaluated by ``evaluate_body(closed_body, flat_body_args)`` (which may rewrite equations).

    Returns:
      The outputs, as a list.
    """
    params = eqn.params
    body = jcore.ClosedJaxpr(params["jaxpr"], ())
    run = jax.shard_map(
        lambda *xs: tuple(evaluate_body(body, list(xs))),
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=set(params["newly_manual_axes"]),
        check_vma=params["check_vma"],
    )
    return list(run(*invals))


def _rebind_body(eqn, invals, evaluate_body: Callable) -> list:
    """A ``scan`` or ``shard_map`` equation run with its body evaluated by ``evaluate_body``."""
    if _jaxpr.is_shard_map(eqn):
        return rebind_shard_map(eqn, invals, evaluate_body)
    return rebind_scan(eqn, invals, evaluate_body)


def _tagged_body(eqn):
    """The body jaxpr a tag may be placed in: a ``scan``'s or a ``shard_map``'s, else ``None``."""
    if _jaxpr.is_scan(eqn):
        return eqn.params["jaxpr"].jaxpr
    if _jaxpr.is_shard_map(eqn):
        return eqn.params["jaxpr"]
    return None


def evaluate_inlined(jaxpr, consts, args, after_bind=None, keep_calls: bool = False) -> list:
    """Evaluate ``jaxpr`` with nested call bodies inlined; ``after_bind(eqn, outs)`` may replace
    the outputs of each re-bound equation. With ``keep_calls``, a nested call (``jit``) whose body
    holds nothing to re-emit for the active engine is bound as the call it is."""
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub_jaxpr = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        if eqn.primitive.name in _jaxpr.INLINED_CALL_PRIMITIVES and not (
            keep_calls and not _holds_translated(sub_jaxpr)
        ):
            sub_consts = sub.consts if hasattr(sub, "consts") else ()
            outs = evaluate_inlined(sub_jaxpr, sub_consts, invals, after_bind, keep_calls)
        else:
            outs = bind_equation(eqn, invals)
            if after_bind is not None:
                outs = after_bind(eqn, outs)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [_read(env, v) for v in jaxpr.outvars]


def inline_calls(closed_jaxpr, flat_args: Sequence):
    """Re-trace ``closed_jaxpr`` with nested ``jit`` / ``closed_call`` bodies inlined.

    Args:
      closed_jaxpr: the jaxpr to flatten.
      flat_args: arguments (arrays, tracers or shape structs) matching its inputs.

    Returns:
      A ``ClosedJaxpr`` computing the same values without nested call equations.
    """
    return jax.make_jaxpr(lambda *a: evaluate_inlined(closed_jaxpr.jaxpr, closed_jaxpr.consts, a))(*flat_args)


def trace_flat(fn: Callable, args: tuple, kwargs: dict, *, inline: bool = True):
    """Trace ``fn(*args, **kwargs)`` with the classic primitives, nested calls inlined (``inline``).

    Traced with the classic primitives (``name``, ``remat2``) under either remat engine, so that
    policies see the same program; re-binding (:func:`bind_equation`) re-emits them for the
    active engine.

    Returns:
      ``(closed_jaxpr, in_tree, out_tree)``; the jaxpr takes the flattened ``(args, kwargs)`` leaves.
    """
    flat_args, in_tree = jax.tree.flatten((args, kwargs))

    def flat_fn(*leaves):
        a, kw = jax.tree.unflatten(in_tree, leaves)
        return fn(*a, **kw)

    with _jax_compat.classic_remat_context():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
        flat = inline_calls(closed, flat_args) if inline else closed
    return flat, in_tree, jax.tree.structure(out_shape)


def evaluate_tagged(closed_jaxpr, tags: Mapping[int, str], flat_args: Sequence) -> list:
    """Evaluate a flattened jaxpr with the outputs of equation ``i`` tagged as ``tags[i]``
    (several outputs: :func:`jremat._engine.tags.output_names`).

    Returns:
      The flat list of outputs.
    """
    position = {id(eqn): i for i, eqn in enumerate(closed_jaxpr.jaxpr.eqns)}
    return evaluate_tagged_where(closed_jaxpr, lambda eqn: tags.get(position.get(id(eqn), -1)), flat_args)


def holds_tag(jaxpr, tag_of: Callable) -> bool:
    """Whether ``tag_of`` tags an equation of ``jaxpr`` or of a ``scan`` or ``shard_map`` body in it."""
    return any(
        tag_of(eqn) is not None or ((body := _tagged_body(eqn)) is not None and holds_tag(body, tag_of))
        for eqn in jaxpr.eqns
    )


def evaluate_tagged_where(closed_jaxpr, tag_of: Callable, flat_args: Sequence) -> list:
    """Evaluate a flattened jaxpr with the outputs of each equation tagged ``tag_of(eqn)`` (``None``:
    untagged), inside ``scan`` and ``shard_map`` bodies too (one whose body holds a tag is re-bound,
    :func:`rebind_scan`, :func:`rebind_shard_map`; both engines save a name wherever it is).

    Returns:
      The flat list of outputs.
    """
    jaxpr = closed_jaxpr.jaxpr
    env = {}
    for v, c in zip(jaxpr.constvars, closed_jaxpr.consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, flat_args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        body = _tagged_body(eqn)
        if body is not None and holds_tag(body, tag_of):
            outs = _rebind_body(eqn, invals, lambda body, args: evaluate_tagged_where(body, tag_of, args))
        else:
            tag = tag_of(eqn)
            if tag is None:
                outs = bind_equation(eqn, invals)
            else:
                outs = bind_named(eqn, invals, _tags.output_names(tag, len(eqn.outvars)))
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [_read(env, v) for v in jaxpr.outvars]


__all__ = [
    "bind_equation",
    "bind_named",
    "bind_translated",
    "evaluate_inlined",
    "evaluate_reemitted",
    "evaluate_tagged",
    "evaluate_tagged_where",
    "holds_tag",
    "inline_calls",
    "rebind_scan",
    "rebind_shard_map",
    "remat3_tags",
    "trace_flat",
    "translates",
]
