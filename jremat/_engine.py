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
from collections.abc import Callable, Iterable, Mapping

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable, checkpoint_name

from jremat import _jax_compat

#: The classic engine: ``jax.checkpoint`` binds ``remat2`` and consults policy callbacks.
CLASSIC = "classic"
#: JAX's remat3 engine (``jax_remat3``): name-based policies, no callback consultation.
REMAT3 = "remat3"
ENGINES = (CLASSIC, REMAT3)

#: Primitive names of a classic ``jax.checkpoint`` / ``checkpoint_name`` in a jaxpr.
CLASSIC_CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})
NAME_PRIMITIVE = "name"

_MEMORY_SPACES = {"pinned_host": jax.memory.Space.Host, "device": jax.memory.Space.Device}
_engine_by_flag: dict = {}

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
    flag = _flag_value()
    engine = _engine_by_flag.get(flag)
    if engine is None:
        jaxpr = jax.make_jaxpr(jax.checkpoint(jax.numpy.sin))(jax.ShapeDtypeStruct((), jax.numpy.float32))
        names = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
        engine = CLASSIC if names & CLASSIC_CHECKPOINT_PRIMITIVES else REMAT3
        _engine_by_flag[flag] = engine
    return engine


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
    return type(callback) in native_types


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

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        if active_engine() == CLASSIC:
            return _classic(fn, save_names, offload_names, offload_src, offload_dst, callback, prevent_cse)(
                *args, **kwargs
            )
        if callback is not None and not natively_understood(callback):
            return _remat3_callback(fn, callback, args, kwargs)
        if callback is not None:
            policy = None if callback is jax.checkpoint_policies.nothing_saveable else callback
            return _remat3_rebound(fn, policy, {}, args, kwargs)
        offload = {name: (offload_src, offload_dst) for name in offload_names}
        return _remat3_names(fn, save_names, offload, args, kwargs)

    return checkpointed


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
    named in ``offload`` go through :func:`offload_function`."""
    from jremat import _program

    for src, dst in offload.values():
        offload_function(src, dst)  # check the memory kinds before tracing anything
    prog = _program.trace_program(fn, *args, **kwargs)
    outs = jax.checkpoint(
        lambda *leaves: _evaluate(prog.closed_jaxpr.jaxpr, prog.closed_jaxpr.consts, leaves, offload),
        policy=policy,
    )(*jax.tree.leaves((args, kwargs)))
    return jax.tree.unflatten(prog.out_tree, outs)


def callback_decisions(program, callback: Callable) -> tuple[frozenset[int], dict[int, tuple[str, str]]]:
    """Ask ``callback`` about every equation of ``program``, as the classic engine does.

    Args:
      program: a :class:`jremat.Program` (nested ``jit`` inlined).
      callback: ``(prim, *in_avals, **params)`` returning a bool or ``Saveable`` /
        ``Recompute`` / ``Offloadable``.

    Returns:
      ``(save, offload)``: equation indices to save, and equation index -> ``(src, dst)``
      memory kinds for those to offload.
    """
    save, offload = set(), {}
    for i, eqn in enumerate(program.closed_jaxpr.jaxpr.eqns):
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
    from jremat import _program

    prog = _program.trace_program(fn, *args, **kwargs)
    eqns = prog.closed_jaxpr.jaxpr.eqns
    save, offload = callback_decisions(prog, callback)
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
        return [own_name[i]] if i in own_name else _program.tag_names(tags[i], prog.ops[i])

    save_names = sorted({n for i in save for n in names_of(i)})
    offload_by_name = {n: offload[i] for i in sorted(offload) for n in names_of(i)}
    tagged = lambda *leaves: _program.evaluate_tagged(prog, tags, leaves)
    outs = _remat3_names(tagged, save_names, offload_by_name, tuple(jax.tree.leaves((args, kwargs))), {})
    return jax.tree.unflatten(prog.out_tree, outs)


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


def _evaluate(jaxpr, consts, args, offload: Mapping[str, tuple[str, str]]) -> list:
    """Evaluate a (classic) jaxpr, re-emitting name tags and checkpoints for the active engine
    and offloading the values tagged with the names in ``offload``."""
    from jremat import _program

    def offload_named(eqn, outs):
        if eqn.primitive.name == NAME_PRIMITIVE and eqn.params["name"] in offload:
            return [offload_function(*offload[eqn.params["name"]])(outs[0])]
        return outs

    return _program._eval_inlined(jaxpr, consts, args, offload_named)


__all__ = [
    "CLASSIC",
    "ENGINES",
    "REMAT3",
    "active_engine",
    "bind_translated",
    "callback_decisions",
    "checkpoint",
    "name_tag",
    "natively_understood",
    "offload_function",
    "tag_name",
    "translates",
]
