"""The one function through which jremat's checkpoints are lowered, for either JAX remat engine.

JAX has two implementations behind ``jax.checkpoint``:

* the *classic* engine (:data:`CLASSIC`): a ``remat2`` primitive whose partial evaluation asks
  the policy callback ``(prim, *avals, **params)`` about every equation, and honours
  ``Offloadable`` decisions by moving residuals to host memory;
* *remat3* (:data:`REMAT3`, the ``jax_remat3`` flag): policies are data. ``checkpoint_name``
  values are saved under ``save_only_these_names`` / ``save_any_names_but_these``,
  ``dot_general`` outputs under ``dots_saveable`` / ``dots_with_no_batch_dims_saveable``,
  everything else is recomputed; any other callback is never called (a silent full remat), and
  there is no offload path.

:func:`checkpoint` takes what a jremat policy means (names to save, names to offload, or a
callback) and lowers it for the engine that ``jax.checkpoint`` uses *when the checkpointed
function is called* (so flipping ``jax_remat3`` between calls is honoured and jit caches, keyed
on the flag, never mix engines). Under remat3:

* names to save and natively understood callbacks go to ``jax.checkpoint`` unchanged, around
  the function traced once with the classic primitives and re-bound (name tags re-emitted as
  below);
* any other callback is asked about every equation of the traced function (nested ``jit``
  inlined), exactly as the classic engine asks it, and the equations it keeps are tagged with
  unique names that are then saved (or offloaded) by name;
* name tags are re-emitted as :func:`name_tag` (a remat3 ``checkpoint_name`` that also
  batches, so ``vmap`` and ``jax.jacfwd`` pass through jremat's checkpoints);
* offloaded names are re-emitted through :func:`offload_function`: the forward pass copies the
  value to host memory, the residual *is* that host copy, and the backward pass copies it back.

The engine is detected from what ``jax.checkpoint`` actually emits, never from a version string.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable, checkpoint_name
from jax.extend import core as jcore

from jremat import _jax_compat
from jremat._cache import BoundedCache

#: Call-like primitives whose body is inlined when a program is flattened.
INLINED_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})

#: The classic engine: ``jax.checkpoint`` binds ``remat2`` and consults policy callbacks.
CLASSIC = "classic"
#: JAX's remat3 engine (``jax_remat3``): name-based policies, no callback consultation.
REMAT3 = "remat3"
ENGINES = (CLASSIC, REMAT3)

#: Primitive names of a classic ``jax.checkpoint`` / ``checkpoint_name`` in a jaxpr.
CLASSIC_CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})
NAME_PRIMITIVE = "name"

_MEMORY_SPACES = {"pinned_host": jax.memory.Space.Host, "device": jax.memory.Space.Device}
_engine_by_flag = BoundedCache(maxsize=8)

# Residuals are attributed to the user's line that called the checkpointed function, not to the
# wrapper below that calls jax.checkpoint.
_jax_compat.exclude_from_tracebacks(__file__)


def _flag_value():
    try:
        return bool(jax.config.jax_remat3)
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
        return CLASSIC if names & CLASSIC_CHECKPOINT_PRIMITIVES else REMAT3

    return _engine_by_flag.get(_flag_value(), probe)


def natively_understood(callback: Callable | None) -> bool:
    """Whether remat3 applies ``callback`` as the classic engine does, without jremat's help.

    True for ``None`` / ``nothing_saveable`` (save only the inputs), ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``save_only_these_names`` and
    ``save_any_names_but_these``. Everything else (``everything_saveable``, offload policies,
    user callbacks) is lowered by :func:`checkpoint` under remat3.
    """
    cp = jax.checkpoint_policies
    if callback is None or callback is cp.nothing_saveable:
        return True
    native_types = (
        type(cp.dots_saveable),
        type(cp.save_only_these_names()),
        type(cp.save_any_names_but_these()),
    )
    return isinstance(callback, native_types)


def checkpoint(
    fn: Callable,
    *,
    save_names: Iterable[str] = (),
    offload_names: Iterable[str] = (),
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
    callback: Callable | None = None,
    prevent_cse: bool = True,
) -> Callable:
    """``fn`` checkpointed so that the backward pass keeps what a jremat policy asks for.

    Give either names (``save_names`` / ``offload_names``: values tagged with
    ``checkpoint_name``) or a JAX policy ``callback``; with neither, only the inputs are kept.
    The lowering is chosen at each call from :func:`active_engine` (see the module docstring).

    Args:
      fn: a function of pytrees of arrays.
      save_names: tensor names whose values stay in device memory.
      offload_names: tensor names whose values go to ``offload_dst`` memory and come back.
      offload_src: memory kind offloaded values come from (``"device"``).
      offload_dst: memory kind they go to (``"pinned_host"``).
      callback: a JAX checkpoint-policy callback ``(prim, *avals, **params)`` returning a bool
        or ``Saveable`` / ``Recompute`` / ``Offloadable``.
      prevent_cse: as in ``jax.checkpoint`` (the classic engine only; remat3 has no such option).

    Returns:
      The checkpointed function.

    Raises:
      ValueError: if both names and a callback are given, or a name is both saved and offloaded.
    """
    save_names = tuple(save_names)
    offload_names = tuple(offload_names)
    if callback is not None and (save_names or offload_names):
        raise ValueError("jremat._engine.checkpoint: give save_names/offload_names or a callback, not both")
    both = sorted(set(save_names) & set(offload_names))
    if both:
        raise ValueError(f"jremat._engine.checkpoint: {both} listed both to save and to offload; give each name once")

    # jax.checkpoint fixes its engine when it is built, so the classic one is built at the first
    # call under the classic engine, not here (a function decorated under remat3 may run under both).
    classic = None
    remat3_traces = TraceCache()

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        nonlocal classic
        if active_engine() == CLASSIC:
            if classic is None:
                classic = _classic(fn, save_names, offload_names, offload_src, offload_dst, callback, prevent_cse)
            return classic(*args, **kwargs)
        if callback is not None and not natively_understood(callback):
            lower = lambda: _remat3_callback(fn, callback, args, kwargs)
        elif callback is not None:
            policy = None if callback is jax.checkpoint_policies.nothing_saveable else callback
            lower = lambda: _remat3_rebound(fn, policy, {}, args, kwargs)
        else:
            offload = {name: (offload_src, offload_dst) for name in offload_names}
            lower = lambda: _remat3_names(fn, save_names, offload, args, kwargs)
        out_tree, flat = remat3_traces.get(args, kwargs, lambda: _split_consts(lower()))
        return jax.tree.unflatten(out_tree, flat(*jax.tree.leaves((args, kwargs))))

    return checkpointed


class TraceCache:
    """Values built once per argument structure and avals, as ``jax.checkpoint`` caches its trace,
    so repeated calls with the same shapes do not trace the user's function again.

    The key also holds the ``jax_remat3`` flag and JAX's trace context (x64 and the other options
    a trace depends on), so switching either traces afresh. A value whose trace closes over a
    tracer of an outer trace (the function reads a value of an enclosing ``jit`` it was not
    given) belongs to that trace alone and is not kept. Several threads may call one cache.

    Args:
      maxsize: values kept; the oldest goes first.
    """

    def __init__(self, maxsize: int = 32):
        self._entries = BoundedCache(maxsize)

    def get(self, args: tuple, kwargs: dict, build: Callable[[], tuple[Any, Sequence]]) -> Any:
        """The value for these arguments; on a miss ``build()`` returns ``(value, consts)``, the
        consts being the trace's closed-over constants."""
        leaves, treedef = jax.tree.flatten((args, kwargs))
        try:
            key = (_flag_value(), _jax_compat.trace_context(), treedef, tuple(jax.typeof(leaf) for leaf in leaves))
            hash(key)
        except TypeError:  # not JAX values: tracing raises JAX's own error
            return build()[0]
        closes_over_tracer = False

        def build_value():
            nonlocal closes_over_tracer
            value, consts = build()
            closes_over_tracer = any(isinstance(c, jax.core.Tracer) for c in consts)
            return value

        return self._entries.get(key, build_value, keep=lambda value: not closes_over_tracer)


def _split_consts(lowered: tuple) -> tuple[tuple, Sequence]:
    out_tree, flat, consts = lowered
    return (out_tree, flat), consts


def _classic(fn, save_names, offload_names, offload_src, offload_dst, callback, prevent_cse):
    cp = jax.checkpoint_policies
    if callback is None:
        if offload_names:
            callback = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(save_names),
                names_which_can_be_offloaded=list(offload_names),
                offload_src=offload_src,
                offload_dst=offload_dst,
            )
        elif save_names:
            callback = cp.save_only_these_names(*save_names)
        else:
            callback = cp.nothing_saveable
    return jax.checkpoint(fn, policy=callback, prevent_cse=prevent_cse)


# ---------------------------------------------------------------------------------------------
# remat3 lowerings
# ---------------------------------------------------------------------------------------------


def _remat3_names(fn, save_names, offload: Mapping[str, tuple[str, str]], args, kwargs):
    policy = jax.checkpoint_policies.save_only_these_names(*save_names) if save_names else None
    return _remat3_rebound(fn, policy, offload, args, kwargs)


def _remat3_rebound(fn, policy, offload: Mapping[str, tuple[str, str]], args, kwargs):
    """``jax.checkpoint(fn, policy=policy)`` under remat3, ``fn`` traced once with the classic
    primitives and re-bound: its name tags become :func:`name_tag` (which batches), the values
    named in ``offload`` go through :func:`offload_function`.

    Returns:
      ``(out_tree, flat_fn, consts)``: ``flat_fn`` takes the flattened argument leaves.
    """
    for src, dst in offload.values():
        offload_function(src, dst)  # check the memory kinds before tracing anything
    # Nested jits stay jits (their compile caches and names kept) unless they hold name tags or
    # checkpoints, which must be re-emitted for remat3.
    closed, _, out_tree = trace_flat(fn, args, kwargs, inline=False)
    flat = jax.checkpoint(
        lambda *leaves: _evaluate(closed.jaxpr, closed.consts, leaves, offload, keep_calls=True),
        policy=policy,
    )
    return out_tree, flat, closed.consts


def callback_decisions(closed_jaxpr, callback: Callable) -> tuple[frozenset[int], dict[int, tuple[str, str]]]:
    """Ask ``callback`` about every equation of a flattened jaxpr, as the classic engine does.

    Args:
      closed_jaxpr: a flattened program's jaxpr (nested ``jit`` inlined: :func:`trace_flat`).
      callback: ``(prim, *in_avals, **params)`` returning a bool or ``Saveable`` /
        ``Recompute`` / ``Offloadable``.

    Returns:
      ``(save, offload)``: equation indices to save, and equation index -> ``(src, dst)``
      memory kinds for those to offload.
    """
    save, offload = set(), {}
    for i, eqn in enumerate(closed_jaxpr.jaxpr.eqns):
        if not eqn.outvars:
            continue
        decision = callback(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
        if isinstance(decision, Offloadable):
            offload[i] = (decision.src, decision.dst)
        elif decision is Saveable or (decision is not Recompute and isinstance(decision, bool) and decision):
            save.add(i)
    return frozenset(save), offload


_callback_tag_counter = iter(range(1 << 62))


def _remat3_callback(fn, callback, args, kwargs):
    closed, _, out_tree = trace_flat(fn, args, kwargs)
    eqns = closed.jaxpr.eqns
    save, offload = callback_decisions(closed, callback)
    # A kept name tag is saved under its own name (the value keeps its name in reports), unless
    # the callback decided differently for two tags of the same name.
    by_name: dict = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive.name == NAME_PRIMITIVE:
            decision = "save" if i in save else offload.get(i)
            by_name.setdefault(eqn.params["name"], set()).add(decision)
    own_name = {
        i: eqns[i].params["name"]
        for i in save | set(offload)
        if eqns[i].primitive.name == NAME_PRIMITIVE and len(by_name[eqns[i].params["name"]]) == 1
    }
    prefix = f"jremat_cb{next(_callback_tag_counter)}"
    tags = {i: f"{prefix}/{i}" for i in sorted(save | set(offload)) if i not in own_name}

    def names_of(i):
        return [own_name[i]] if i in own_name else output_tag_names(tags[i], len(eqns[i].outvars))

    save_names = sorted({n for i in save for n in names_of(i)})
    offload_by_name = {n: offload[i] for i in sorted(offload) for n in names_of(i)}
    tagged = lambda *leaves: evaluate_tagged(closed, tags, leaves)
    _, flat, _ = _remat3_names(tagged, save_names, offload_by_name, tuple(jax.tree.leaves((args, kwargs))), {})
    return out_tree, lambda *leaves: flat(*leaves), closed.consts


def offload_function(src: str, dst: str) -> Callable:
    """An identity function whose remat3 residual is a copy of its input in ``dst`` memory.

    Inside a remat3 checkpoint, the forward pass copies the value from ``src`` to ``dst`` memory
    and keeps that copy; the backward pass copies it back to ``src`` instead of recomputing it
    (:func:`jremat._jax_compat.remat3_offload`). Elsewhere (a call that is not differentiated,
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
    :func:`jremat._jax_compat.remat3_name_tag` (which also batches under ``vmap``) under remat3."""
    if active_engine() == REMAT3:
        return _jax_compat.remat3_name_tag(x, name)
    return checkpoint_name(x, name)


# ---------------------------------------------------------------------------------------------
# Re-emitting classic equations under remat3
# ---------------------------------------------------------------------------------------------


def tag_name(eqn) -> str | None:
    """The tensor name of a ``checkpoint_name`` equation under either engine, else ``None``.

    A classic tag is a ``name`` equation; a remat3 tag is a ``call_hi_primitive`` equation.
    """
    if eqn.primitive.name == NAME_PRIMITIVE:
        return eqn.params["name"]
    return _jax_compat.remat3_tag_name(eqn)


def translates(eqn) -> bool:
    """Whether ``eqn`` is a classic ``checkpoint_name`` / ``jax.checkpoint`` equation that must be
    re-emitted for remat3 when re-bound (true only while remat3 is active)."""
    name = eqn.primitive.name
    return (name == NAME_PRIMITIVE or name in CLASSIC_CHECKPOINT_PRIMITIVES) and active_engine() == REMAT3


def bind_translated(eqn, invals) -> list:
    """Re-emit a classic name tag or checkpoint equation (see :func:`translates`) for remat3.

    A ``name`` equation becomes :func:`name_tag` (remat3's name tag); a ``remat2`` equation
    becomes :func:`checkpoint` of its body with the same policy, the body re-emitted the same way.

    Returns:
      The equation's outputs, as a list.
    """
    if eqn.primitive.name == NAME_PRIMITIVE:
        return [name_tag(invals[0], eqn.params["name"])]
    body = eqn.params["jaxpr"]
    consts = body.consts if hasattr(body, "consts") else ()
    body = body.jaxpr if hasattr(body, "jaxpr") else body
    policy = eqn.params.get("policy")
    fun = lambda *xs: _evaluate(body, consts, xs, {})
    return list(checkpoint(fun, callback=policy)(*invals))


def _evaluate(jaxpr, consts, args, offload: Mapping[str, tuple[str, str]], keep_calls: bool = False) -> list:
    """Evaluate a (classic) jaxpr, re-emitting name tags and checkpoints for the active engine
    and offloading the values tagged with the names in ``offload``; ``keep_calls``: nested calls
    with nothing to re-emit stay calls."""

    def offload_named(eqn, outs):
        if eqn.primitive.name == NAME_PRIMITIVE and eqn.params["name"] in offload:
            return [offload_function(*offload[eqn.params["name"]])(outs[0])]
        return outs

    return evaluate_inlined(jaxpr, consts, args, offload_named, keep_calls=keep_calls)


def _holds_translated(jaxpr) -> bool:
    """Whether ``jaxpr`` (or one nested in it) holds a name tag or a classic checkpoint."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == NAME_PRIMITIVE or eqn.primitive.name in CLASSIC_CHECKPOINT_PRIMITIVES:
            return True
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if isinstance(inner, jcore.Jaxpr) and _holds_translated(inner):
                    return True
    return False


# ---------------------------------------------------------------------------------------------
# Flattened programs: tracing with nested calls inlined, and re-evaluation (tags added)
# ---------------------------------------------------------------------------------------------


def _read(env, v):
    return v.val if isinstance(v, jcore.Literal) else env[v]


def bind_equation(eqn, invals) -> list:
    """Bind ``eqn``'s primitive to ``invals`` with its source line and name stack, for the active engine.

    Returns:
      The outputs, as a list.
    """
    if translates(eqn):  # a classic name tag / checkpoint re-bound under jax_remat3
        return bind_translated(eqn, invals)
    if eqn.primitive.name == "scan" and active_engine() == REMAT3 and _holds_translated(eqn.params["jaxpr"].jaxpr):
        return rebind_scan(eqn, invals, lambda body, args: evaluate_inlined(body.jaxpr, body.consts, args))
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if _jax_compat.source_user_context is not None and _jax_compat.source_current_name_stack is not None:
        name_stack = _jax_compat.source_current_name_stack() + eqn.source_info.name_stack
        with _jax_compat.source_user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **bind_params)
    else:  # pragma: no cover
        outs = eqn.primitive.bind(*invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


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
        if eqn.primitive.name in INLINED_CALL_PRIMITIVES and not (keep_calls and not _holds_translated(sub_jaxpr)):
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


def output_tag_names(tag: str, n_outputs: int) -> list[str]:
    """The checkpoint names :func:`evaluate_tagged` gives an equation's outputs for ``tag``."""
    return [tag] if n_outputs == 1 else [f"{tag}.{j}" for j in range(n_outputs)]


def evaluate_tagged(closed_jaxpr, tags: Mapping[int, str], flat_args: Sequence) -> list:
    """Evaluate a flattened jaxpr with the outputs of equation ``i`` tagged as ``tags[i]``
    (several outputs: :func:`output_tag_names`).

    Returns:
      The flat list of outputs.
    """
    jaxpr = closed_jaxpr.jaxpr
    env = {}
    for v, c in zip(jaxpr.constvars, closed_jaxpr.consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, flat_args):
        env[v] = a
    for i, eqn in enumerate(jaxpr.eqns):
        outs = bind_equation(eqn, [_read(env, v) for v in eqn.invars])
        tag = tags.get(i)
        if tag is not None:
            outs = [name_tag(o, n) for o, n in zip(outs, output_tag_names(tag, len(outs)))]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [_read(env, v) for v in jaxpr.outvars]


__all__ = [
    "CLASSIC",
    "ENGINES",
    "REMAT3",
    "INLINED_CALL_PRIMITIVES",
    "active_engine",
    "bind_equation",
    "bind_translated",
    "callback_decisions",
    "checkpoint",
    "evaluate_inlined",
    "evaluate_tagged",
    "inline_calls",
    "output_tag_names",
    "trace_flat",
    "name_tag",
    "natively_understood",
    "offload_function",
    "tag_name",
    "translates",
]
