"""Lowering jremat's checkpoints for either JAX remat engine.

Every checkpoint jremat builds goes through :func:`lower_checkpoint` (a policy's chosen values
through :func:`checkpoint_chosen`, which tags them and calls it). Programs are traced and
evaluated again by the jaxpr interpreter, :mod:`jremat._engine.interpreter`.

JAX has two implementations behind ``jax.checkpoint``:

* the *classic* engine (:data:`jremat._engine.active.CLASSIC`): a ``remat2`` primitive whose partial evaluation asks
  the policy callback ``(prim, *avals, **params)`` about every equation, and honours
  ``Offloadable`` decisions by moving residuals to host memory;
* *remat3* (:data:`jremat._engine.active.REMAT3`, the ``jax_remat3`` flag): policies are data. ``checkpoint_name``
  values are saved under ``save_only_these_names`` / ``save_any_names_but_these``,
  ``dot_general`` outputs under ``dots_saveable`` / ``dots_with_no_batch_dims_saveable``,
  everything else is recomputed; any other callback is never called (a silent full remat), and
  there is no offload path.

:func:`lower_checkpoint` takes what a jremat policy means (names to save, names to offload, or a
callback) and lowers it for the engine that ``jax.checkpoint`` uses *when the checkpointed
function is called* (so flipping ``jax_remat3`` between calls is honoured and jit caches, keyed
on the flag, never mix engines). Under remat3:

* names to save and natively understood callbacks go to ``jax.checkpoint`` unchanged, around
  the function traced once with the classic primitives and re-bound (name tags re-emitted as
  below);
* any other callback is asked about every equation of the traced function (nested ``jit``
  inlined), exactly as the classic engine asks it (its answers read by
  :func:`jremat._engine.tags.callback_decision`), and the equations it keeps are tagged with unique
  names (:mod:`jremat._engine.tags`) that are then saved (or offloaded) by name;
* name tags are re-emitted as :func:`jremat._engine.active.name_tag` (a remat3 ``checkpoint_name`` that also
  batches, so ``vmap`` and ``jax.jacfwd`` pass through jremat's checkpoints);
* offloaded names are re-emitted through :func:`jremat._engine.active.offload_function`: the forward pass copies the
  value to host memory, the residual *is* that host copy, and the backward pass copies it back;
* a function holding a ``jax.shard_map`` is checkpointed with the classic engine (JAX 0.10.2's
  remat3 has no ``shard_map`` rule), from the same single trace.

The engine is detected from what ``jax.checkpoint`` actually emits, never from a version string.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from jremat._engine import interpreter as _interpreter
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._engine import tags as _tags
from jremat._engine.active import CLASSIC, active_engine, offload_function, remat3_flag
from jremat._engine.cache import BoundedCache

# Residuals are attributed to the user's line that called the checkpointed function, not to the
# wrapper below that calls jax.checkpoint.
_jax_compat.exclude_from_tracebacks(__file__)


# JAX's policy classes, reached through public policy objects (their typing is JAX-internal).
DotsSaveable: Any = type(jax.checkpoint_policies.dots_saveable)
SaveOnlyTheseNames: Any = type(jax.checkpoint_policies.save_only_these_names())


@dataclasses.dataclass(frozen=True)
class DotsAndNames(DotsSaveable, SaveOnlyTheseNames):
    """``dots_saveable`` (or ``dots_with_no_batch_dims_saveable``) and ``save_only_these_names`` as
    one JAX policy. remat3 decides by the policy's type (a matmul is saved for a ``DotsSaveable``, a
    name for a ``SaveOnlyTheseNames``), inside ``scan`` bodies too; a policy of both types keeps
    both there. The classic engine calls it: a matmul the dots policy saves, or a listed name."""

    def __call__(self, prim, *args, **params):
        return DotsSaveable.__call__(self, prim, *args, **params) or SaveOnlyTheseNames.__call__(
            self, prim, *args, **params
        )


@dataclasses.dataclass(frozen=True)
class GroupedDotsSaveable(DotsSaveable):
    """``dots_saveable`` (or ``dots_with_no_batch_dims_saveable``) that keeps grouped matmuls
    (``jax.lax.ragged_dot``, or a kernel shaped like one such as megablox ``gmm``:
    :func:`jremat._engine.jaxpr.is_grouped_matmul`) too, as jremat's ``dots`` does.

    JAX's dots policies name ``dot_general`` (and convolutions) only, so a mixture of experts'
    grouped matmuls are recomputed under them. The classic engine calls this policy; under
    remat3 (which decides by the policy's type) the checkpoint's grouped matmul outputs are
    tagged :data:`GROUPED_MATMUL_TAG` and kept by name beside the native dots policy
    (:class:`DotsAndNames`). ``only_if_no_batch_dims``: a grouped matmul has no batch dimension,
    so it is kept either way. ``saveable_names``: ``checkpoint_name`` tags kept as well (as
    :class:`DotsAndNames` adds them to JAX's dots policies).
    """

    saveable_names: frozenset[str] = frozenset()

    def __call__(self, prim, *args, **params):
        if prim.name == _jaxpr.RAGGED_DOT_GENERAL:
            return True
        if prim.name in _jaxpr.KERNEL_PRIMITIVES and _jaxpr.grouped_matmul_kernel(args, params.get("out_avals")):
            return True  # a grouped matmul kernel (megablox gmm): kept like the primitive
        if prim.name == _jaxpr.NAME and params.get("name") in self.saveable_names:
            return True
        return DotsSaveable.__call__(self, prim, *args, **params)


#: The name under which remat3 keeps the grouped matmuls of a :class:`GroupedDotsSaveable` checkpoint.
GROUPED_MATMUL_TAG = "jremat_grouped_matmul"


def natively_understood(callback: Callable | None) -> bool:
    """Whether remat3 applies ``callback`` as the classic engine does, without jremat's help.

    True for ``None`` / ``nothing_saveable`` (save only the inputs), ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``save_only_these_names`` and
    ``save_any_names_but_these``, and :class:`DotsAndNames` (dots and names at once). Everything
    else (``everything_saveable``, offload policies, user callbacks, and a subclass of those types,
    which may save more than remat3 asks it about) is lowered by :func:`lower_checkpoint` under
    remat3.
    """
    cp = jax.checkpoint_policies
    if callback is None or callback is cp.nothing_saveable:
        return True
    # The exact types: a subclass may save more than remat3 would ask it about.
    native_types = (DotsSaveable, SaveOnlyTheseNames, type(cp.save_any_names_but_these()), DotsAndNames)
    return type(callback) in native_types


def same_under_batching(callback: Callable | None) -> bool:
    """Whether ``callback`` keeps the same values of a program whether or not a ``vmap`` batched it.

    True for ``None`` / ``nothing_saveable`` / ``everything_saveable``, ``dots_saveable`` (a
    batched matmul is a matmul), and the name-based ``save_only_these_names`` /
    ``save_any_names_but_these`` (and :class:`DotsAndNames` without the batch-dimension rule);
    False for ``dots_with_no_batch_dims_saveable`` (a ``vmap`` adds batch dimensions) and any
    other callable, which may read shapes or parameters.
    """
    cp = jax.checkpoint_policies
    if callback is None or callback is cp.nothing_saveable or callback is cp.everything_saveable:
        return True
    if type(callback) in (DotsSaveable, DotsAndNames):
        dots: Any = callback
        return not dots.only_if_no_batch_dims
    return type(callback) in (SaveOnlyTheseNames, type(cp.save_any_names_but_these()))


def lower_checkpoint(
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
        raise ValueError(
            "jremat._engine.lowering.lower_checkpoint: give save_names/offload_names or a callback, not both"
        )
    both = sorted(set(save_names) & set(offload_names))
    if both:
        raise ValueError(
            f"jremat._engine.lowering.lower_checkpoint: {both} listed both to save and to offload; give each name once"
        )
    offload = {name: (offload_src, offload_dst) for name in offload_names}
    return _lower(fn, save_names, offload, callback, prevent_cse)


def _lower(
    fn: Callable,
    save_names: tuple[str, ...],
    offload: Mapping[str, tuple[str, str]],
    callback: Callable | None,
    prevent_cse: bool,
) -> Callable:
    """:func:`lower_checkpoint` with the offloaded names mapped to their ``(src, dst)`` memory kinds."""
    # jax.checkpoint fixes its engine when it is built, so the classic one is built at the first
    # call under the classic engine, not here (a function decorated under remat3 may run under both).
    classic = None
    remat3_traces = TraceCache()

    def remat3_lowering(fn, args, kwargs):
        if isinstance(callback, GroupedDotsSaveable):
            return _remat3_grouped_dots(fn, callback, args, kwargs)
        if callback is not None and not natively_understood(callback):
            return _remat3_callback(fn, callback, args, kwargs)
        if callback is not None:
            policy = None if callback is jax.checkpoint_policies.nothing_saveable else callback
            return _remat3_rebound(fn, policy, {}, args, kwargs)
        return _remat3_names(fn, save_names, offload, args, kwargs)

    def lower_remat3(args, kwargs):
        # The user's function is traced once; a checkpoint holding a shard_map goes to the classic
        # engine (_holds_shard_map), any other is lowered for remat3 from that trace.
        with _interpreter.remat3_tags():
            closed, _, out_tree = _interpreter.trace_flat(fn, args, kwargs, inline=False)
        replay = lambda *leaves: _interpreter.evaluate_inlined(closed.jaxpr, closed.consts, leaves, keep_calls=True)
        leaves = tuple(jax.tree.leaves((args, kwargs)))
        if _holds_shard_map(closed.jaxpr):
            classic_flat = _classic(replay, save_names, offload, callback, prevent_cse, classic_engine=True)

            def flat(*leaves):
                with _jax_compat.classic_remat_context():
                    return classic_flat(*leaves)

            return (out_tree, flat), closed.consts
        _, flat, _ = remat3_lowering(replay, leaves, {})
        return (out_tree, flat), closed.consts

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        nonlocal classic
        if active_engine() == CLASSIC:
            if classic is None:
                classic = _classic(fn, save_names, offload, callback, prevent_cse)
            return classic(*args, **kwargs)
        out_tree, flat = remat3_traces.get(args, kwargs, lambda: lower_remat3(args, kwargs))
        return jax.tree.unflatten(out_tree, flat(*jax.tree.leaves((args, kwargs))))

    return checkpointed


def _holds_shard_map(jaxpr) -> bool:
    """Whether a checkpoint of ``jaxpr`` must use the classic engine: JAX's remat3 has no rule for
    ``shard_map`` (its trace lacks ``process_shard_map``), so a checkpoint that holds one is applied
    with the classic engine, which keeps the same policy's values inside it."""
    return any(_jaxpr.is_shard_map(eqn) for eqn in _jaxpr.equations(jaxpr))


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
            key = (remat3_flag(), _jax_compat.trace_context(), treedef, tuple(jax.typeof(leaf) for leaf in leaves))
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


def _classic(fn, save_names, offload: Mapping[str, tuple[str, str]], callback, prevent_cse, classic_engine=False):
    """``jax.checkpoint`` of ``fn`` with the policy (the classic engine's; ``classic_engine``: built
    under :func:`jremat._engine.jax_compat.classic_remat_context` whatever the flag)."""
    if classic_engine:
        with _jax_compat.classic_remat_context():
            return _classic(fn, save_names, offload, callback, prevent_cse)
    cp = jax.checkpoint_policies
    if callback is None:
        if offload:
            pairs = set(offload.values())
            if len(pairs) > 1:
                raise ValueError(
                    f"the classic engine offloads all names between one pair of memory kinds; got {sorted(pairs)}"
                )
            ((offload_src, offload_dst),) = pairs
            callback = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(save_names),
                names_which_can_be_offloaded=list(offload),
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
    primitives and re-bound: its name tags become :func:`jremat._engine.active.name_tag` (which batches), the values
    named in ``offload`` go through :func:`jremat._engine.active.offload_function`.

    Returns:
      ``(out_tree, flat_fn, consts)``: ``flat_fn`` takes the flattened argument leaves.
    """
    for src, dst in offload.values():
        offload_function(src, dst)  # check the memory kinds before tracing anything
    # Nested jits stay jits (their compile caches and names kept) unless they hold name tags or
    # checkpoints, which must be re-emitted for remat3.
    closed, _, out_tree = _interpreter.trace_flat(fn, args, kwargs, inline=False)
    flat = jax.checkpoint(
        lambda *leaves: _interpreter.evaluate_reemitted(closed.jaxpr, closed.consts, leaves, offload, keep_calls=True),
        policy=policy,
    )
    return out_tree, flat, closed.consts


def callback_decisions(closed_jaxpr, callback: Callable) -> tuple[frozenset[int], dict[int, tuple[str, str]]]:
    """Ask ``callback`` about every equation of a flattened jaxpr, as the classic engine does.

    Args:
      closed_jaxpr: a flattened program's jaxpr (nested ``jit`` inlined:
        :func:`jremat._engine.interpreter.trace_flat`).
      callback: ``(prim, *in_avals, **params)`` returning a bool or ``Saveable`` /
        ``Recompute`` / ``Offloadable`` (read by :func:`jremat._engine.tags.callback_decision`).

    Returns:
      ``(save, offload)``: equation indices to save, and equation index -> ``(src, dst)``
      memory kinds for those to offload.

    Raises:
      TypeError: if the callback gives an answer the classic engine refuses too.
    """
    save, offload = set(), {}
    for i, eqn in enumerate(closed_jaxpr.jaxpr.eqns):
        if not eqn.outvars:
            continue
        decision, answer = _tags.ask_callback(callback, eqn)
        if decision == _tags.OFFLOAD:
            offload[i] = (answer.src, answer.dst)
        elif decision == _tags.SAVE:
            save.add(i)
    return frozenset(save), offload


def _remat3_grouped_dots(fn, callback, args, kwargs):
    """:class:`GroupedDotsSaveable` under remat3: the native dots policy, and the grouped matmuls
    of the checkpoint's program kept by name."""
    closed, _, out_tree = _interpreter.trace_flat(fn, args, kwargs)
    # Inside scan bodies too: remat3 saves a name wherever it is, as it applies the dots policy
    # inside loop bodies.
    tag_of = lambda eqn: GROUPED_MATMUL_TAG if _jaxpr.is_grouped_matmul(eqn) else None
    names = callback.saveable_names | ({GROUPED_MATMUL_TAG} if _interpreter.holds_tag(closed.jaxpr, tag_of) else set())
    policy = DotsAndNames(saveable_names=frozenset(names), only_if_no_batch_dims=callback.only_if_no_batch_dims)
    tagged = lambda *leaves: _interpreter.evaluate_tagged_where(closed, tag_of, leaves)
    _, flat, _ = _remat3_rebound(tagged, policy, {}, tuple(jax.tree.leaves((args, kwargs))), {})
    return out_tree, flat, closed.consts


def _remat3_callback(fn, callback, args, kwargs):
    closed, _, out_tree = _interpreter.trace_flat(fn, args, kwargs)
    eqns = closed.jaxpr.eqns
    save, offload = callback_decisions(closed, callback)
    # A kept name tag is saved under its own name (the value keeps its name in reports), unless
    # the callback decided differently for two tags of the same name.
    tag_of = {i: tag for i, eqn in enumerate(eqns) if (tag := _jaxpr.name_tag(eqn)) is not None}
    by_name: dict = {}
    for i, tag in tag_of.items():
        by_name.setdefault(tag, set()).add("save" if i in save else offload.get(i))
    own_name = {i: tag_of[i] for i in save | set(offload) if i in tag_of and len(by_name[tag_of[i]]) == 1}
    flat = checkpoint_chosen(closed, save, offload, own_names=own_name)
    return out_tree, flat, closed.consts


def checkpoint_chosen(
    closed_jaxpr,
    save: Iterable[int],
    offload: Mapping[int, tuple[str, str]],
    *,
    own_names: Mapping[int, str] | None = None,
    saved_tags: Iterable[str] = (),
    prevent_cse: bool = True,
) -> Callable:
    """A flattened program checkpointed to keep the outputs of the equations a policy chose.

    The pipeline behind a :class:`jremat.PlanPolicy`'s plan and a callback's answers under
    remat3 alike: the chosen outputs are tagged with fresh internal
    names (:mod:`jremat._engine.tags`), the program is evaluated with those tags
    (:func:`jremat._engine.interpreter.evaluate_tagged`), and the result is checkpointed by name
    (:func:`lower_checkpoint`).

    Args:
      closed_jaxpr: the flattened program (:func:`jremat._engine.interpreter.trace_flat`).
      save: indices of the equations whose outputs stay in device memory.
      offload: equation index -> ``(src, dst)`` memory kinds, for outputs moved out and back.
      own_names: equation index -> the name its output is saved under instead of a fresh tag
        (a ``checkpoint_name`` tag kept by its own name).
      saved_tags: further ``checkpoint_name`` tags to save wherever they are.
      prevent_cse: as in :func:`lower_checkpoint`.

    Returns:
      A function of the program's flattened inputs returning its flat outputs.
    """
    save = frozenset(save)
    own_names = own_names or {}
    eqns = closed_jaxpr.jaxpr.eqns
    prefix = _tags.new_prefix()
    tags = {i: _tags.equation_tag(prefix, i) for i in sorted(save | set(offload)) if i not in own_names}

    def names_of(i):
        return [own_names[i]] if i in own_names else _tags.output_names(tags[i], len(eqns[i].outvars))

    save_names = tuple(sorted({n for i in save for n in names_of(i)} | set(saved_tags)))
    offload_by_name = {n: offload[i] for i in sorted(offload) for n in names_of(i)}
    tagged = lambda *leaves: _interpreter.evaluate_tagged(closed_jaxpr, tags, leaves)
    return _lower(tagged, save_names, offload_by_name, None, prevent_cse)


__all__ = [
    "TraceCache",
    "callback_decisions",
    "checkpoint_chosen",
    "lower_checkpoint",
    "natively_understood",
    "same_under_batching",
    "DotsAndNames",
    "GROUPED_MATMUL_TAG",
    "GroupedDotsSaveable",
]
