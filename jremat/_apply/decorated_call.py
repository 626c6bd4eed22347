"""How a decorated function runs (:mod:`jremat._apply.decorator`): ``jax.checkpoint``'s calling
convention (static arguments, ``prevent_cse``, one trace per argument structure and avals) on a
plain function, and the lifting of Flax NNX graph nodes and Linen modules.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jremat._apply.policy import Policy
from jremat._engine.cache import BoundedCache


def _is_dynamic(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def call_rematerialized(fn: Callable, policy: Policy, args: tuple, kwargs: dict, *, prevent_cse: bool = True):
    """Call ``fn(*args, **kwargs)`` rematerialized under ``policy``, non-array leaves static.

    Array leaves of ``(args, kwargs)`` become the checkpointed function's inputs; every other
    leaf (Python scalars, strings, ``None``, ...) is closed over as a constant of the trace.

    Args:
      fn: the function to call.
      policy: the :class:`Policy`.
      args: positional arguments (pytrees).
      kwargs: keyword arguments (pytrees).
      prevent_cse: passed to ``jax.checkpoint``.

    Returns:
      ``fn``'s output.
    """
    with_dynamic, leaves, dynamic_positions = split_static(fn, args, kwargs)
    return policy.wrap(with_dynamic, prevent_cse=prevent_cse)(*[leaves[i] for i in dynamic_positions])


def split_static(
    fn: Callable, args: tuple, kwargs: dict, is_dynamic: Callable = _is_dynamic
) -> tuple[Callable, list, list[int]]:
    """``fn(*args, **kwargs)`` as a function of its array leaves alone, the others closed over.

    Args:
      fn: the function.
      args: positional arguments (pytrees).
      kwargs: keyword arguments (pytrees).
      is_dynamic: which leaves are inputs (default: arrays); the others are closed over.

    Returns:
      ``(flat_fn, leaves, dynamic_positions)``: ``flat_fn(*[leaves[i] for i in dynamic_positions])``
      equals ``fn(*args, **kwargs)``; ``leaves`` are all leaves of ``(args, kwargs)``.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic_positions = [i for i, leaf in enumerate(leaves) if is_dynamic(leaf)]

    def with_dynamic(*dynamic):
        full = list(leaves)
        for i, value in zip(dynamic_positions, dynamic):
            full[i] = value
        a, kw = jax.tree.unflatten(treedef, full)
        return fn(*a, **kw)

    return with_dynamic, leaves, dynamic_positions


@dataclasses.dataclass(frozen=True)
class _Options:
    """``jax.checkpoint``'s options, checked."""

    prevent_cse: bool | tuple
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...] = ()
    #: Non-array leaves of the arguments are static (as ``eqx.filter_checkpoint``), not traced.
    filtered: bool = False

    @property
    def any_cse(self) -> bool:
        """Whether any argument asks for CSE prevention (what the Flax paths, which take a bool, use)."""
        return self.prevent_cse if isinstance(self.prevent_cse, bool) else any(jax.tree.leaves(self.prevent_cse))


class _Static:
    """A static argument in a cache key: by value where hashable, by identity otherwise (as JAX)."""

    def __init__(self, value):
        self.value = value
        try:
            self.hash, self.hashable = hash(value), True
        except TypeError:
            self.hash, self.hashable = id(value), False

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Static) or self.hashable != other.hashable:
            return False
        return self.value == other.value if self.hashable else self.value is other.value


_MAX_TRACES = 32


def _plain_call(fn: Callable, chosen: Policy, options: _Options, traced: BoundedCache, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` rematerialized the way ``jax.checkpoint`` calls a function."""
    nums = options.static_argnums
    if not all(-len(args) <= d < len(args) for d in nums):
        raise ValueError(
            "the `static_argnums` argument to `jax.checkpoint` / `jax.remat` can only take integer values greater "
            f"than or equal to `-len(args)` and less than `len(args)`, but got {nums}, while `len(args)` = {len(args)}"
        )
    static_positions = frozenset(d % len(args) for d in nums)
    dynamic_args = tuple(a for i, a in enumerate(args) if i not in static_positions)
    statics = tuple((i, _Static(args[i])) for i in sorted(static_positions))
    static_kwargs = tuple((k, _Static(kwargs[k])) for k in sorted(kwargs) if k in options.static_argnames)
    kwargs = {k: v for k, v in kwargs.items() if k not in options.static_argnames}
    leaves, in_tree = jax.tree.flatten((dynamic_args, kwargs))
    cse = _leaf_prevent_cse(options.prevent_cse, dynamic_args, kwargs)
    if options.filtered:
        traced_positions = tuple(i for i, leaf in enumerate(leaves) if _is_dynamic(leaf))
        # by type too: True == 1 == 1.0, yet each traces to a different program
        constants = tuple((i, type(leaf), _Static(leaf)) for i, leaf in enumerate(leaves) if not _is_dynamic(leaf))
        if not isinstance(cse, bool):
            cse = tuple(cse[i] for i in traced_positions)
    else:
        traced_positions, constants = tuple(range(len(leaves))), ()
    traced_leaves = [leaves[i] for i in traced_positions]
    n_leaves = len(leaves)  # not `leaves` in flat_fn: the cached trace must not keep this call's arrays alive
    # TypeError (JAX's) on a value JAX cannot trace
    key = (in_tree, tuple(jax.typeof(leaf) for leaf in traced_leaves), constants, statics, static_kwargs, cse)

    def build():
        # filtered: (out_tree, array positions, leaves) of the output, set by each trace
        static_out: list[tuple[Any, tuple[int, ...], list] | None] = [None]

        def flat_fn(*dynamic_leaves):
            all_leaves = [None] * n_leaves
            for i, _, value in constants:
                all_leaves[i] = value.value
            for i, leaf in zip(traced_positions, dynamic_leaves):
                all_leaves[i] = leaf
            a, kw = jax.tree.unflatten(in_tree, all_leaves)
            full = list(a)
            for i, value in statics:
                full.insert(i, value.value)
            out = fn(*full, **kw, **{k: value.value for k, value in static_kwargs})
            if not options.filtered:
                return out
            # As eqx.filter_checkpoint: only array outputs leave the checkpoint; the rest (a Python
            # int, a function) is returned as it is, from this trace (the call may reuse a cached one).
            out_leaves, out_tree = jax.tree.flatten(out)
            array_positions = tuple(i for i, leaf in enumerate(out_leaves) if _is_dynamic(leaf))
            kept = [None if i in array_positions else leaf for i, leaf in enumerate(out_leaves)]
            static_out[0] = (out_tree, array_positions, kept)
            return [out_leaves[i] for i in array_positions]

        return chosen.wrap(flat_fn, prevent_cse=cse), static_out

    flat, static_out = traced.get(key, build)
    try:
        out = flat(*traced_leaves)
    except jax.errors.ConcretizationTypeError as err:
        if not options.filtered:
            traced_args = tuple(None if i in static_positions else a for i, a in enumerate(args))
            _note_traced_python_scalars(err, (traced_args, kwargs))
        raise
    if not options.filtered:
        return out
    out_tree, array_positions, out_leaves = static_out[0]
    out_leaves = list(out_leaves)
    for i, value in zip(array_positions, out):
        out_leaves[i] = value
    return jax.tree.unflatten(out_tree, out_leaves)


def _note_traced_python_scalars(err: Exception, arguments) -> None:
    """Add a note to a concretization error naming the Python scalars that were traced, and the filtered form.

    A Python ``bool``/``int``/``float`` leaf inside a pytree argument (an Equinox module's
    dropout rate or ``inference`` flag) is traced by ``jax.checkpoint`` semantics; branching on
    it is the error. The note only adds to the message (Python 3.11+ notes); the error is JAX's.
    """
    add_note = getattr(err, "add_note", None)
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arguments)[0]
        if isinstance(leaf, (bool, int, float))
    ]
    if add_note is None or not paths:
        return
    shown = ", ".join(f"args{p[3:]}" if p.startswith("[0]") else f"kwargs{p[3:]}" for p in paths[:8])
    more = f" and {len(paths) - 8} more" if len(paths) > 8 else ""
    add_note(
        f"jremat.checkpoint traces Python scalars as jax.checkpoint does, and these arguments hold Python "
        f"scalars, now traced: {shown}{more}. To keep every non-array leaf static (an Equinox module's float "
        "and bool fields, an inference= flag), use jremat.filter_checkpoint(fn, policy), which works as "
        "eqx.filter_checkpoint; or name the arguments in static_argnums / static_argnames."
    )


def _leaf_prevent_cse(prevent_cse, args: tuple, kwargs: dict):
    """A bool, or one bool per argument leaf (JAX's broadcast of the prefix over the arguments)."""
    if isinstance(prevent_cse, bool):
        return prevent_cse
    full = (args, kwargs) if kwargs else args
    try:
        broadcast = jax.tree.broadcast(prevent_cse, full)
    except ValueError as err:
        raise ValueError(
            f"prevent_cse={prevent_cse!r} is not a prefix of the arguments' pytree (one bool per argument, or a "
            f"pytree of bools matching an argument); {err}"
        ) from None
    flags = jax.tree.leaves(broadcast)
    if len(flags) != len(jax.tree.leaves(full)) or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"prevent_cse={prevent_cse!r} must hold one bool for each argument leaf or subtree")
    return tuple(flags)


def _flax_module_types() -> tuple[type, ...]:
    """Flax's Linen and NNX module classes, of the APIs the program has imported (never imports Flax).

    A Flax module or graph node can only exist once its API is loaded, so a user of plain JAX,
    Equinox or Haiku never pays for importing Flax.
    """
    return tuple(sys.modules[api].Module for api in ("flax.linen", "flax.nnx") if api in sys.modules)


def _has_graph_node(tree) -> bool:
    graph = sys.modules.get("flax.nnx.graph")
    if graph is None:
        return False
    return any(graph.is_graph_node(leaf) for leaf in jax.tree.leaves(tree, is_leaf=graph.is_graph_node))


_NNX_CONTEXT = "jremat"


def _function(fn: Callable, chosen: Policy, options: _Options) -> Callable:
    """Rematerialize a function; NNX graph nodes in its arguments and Linen ``self`` are lifted."""
    linen_lifted: list[Callable] = []
    linen_lock = threading.Lock()
    # per argument structure, avals and static values: the rematerialized flat function
    traced = BoundedCache(_MAX_TRACES)

    @functools.wraps(fn)
    def rematerialized(*args, **kwargs):
        linen = sys.modules.get("flax.linen")
        if linen is not None and args and isinstance(args[0], linen.Module):
            with linen_lock:
                if not linen_lifted:  # a Linen method: lifted like nn.remat, on its first call
                    linen_lifted.append(_linen(fn, chosen, options.any_cse, ("__call__",)))
            return linen_lifted[0](*args, **kwargs)
        if _has_graph_node((args, kwargs)):
            from flax.nnx.transforms import general

            def merged(args_kwargs):
                a, kw = args_kwargs
                return fn(*a, **kw)

            def checkpointed(pure_args_kwargs):
                inner = general.merge_inputs(merged, ctxtag=_NNX_CONTEXT)
                return call_rematerialized(inner, chosen, (pure_args_kwargs,), {}, prevent_cse=options.any_cse)

            return general.split_inputs(checkpointed, ctxtag=_NNX_CONTEXT)((args, kwargs))
        return _plain_call(fn, chosen, options, traced, args, kwargs)

    return rematerialized


def _lift_policy(fn, *, chosen: Policy, prevent_cse: bool):
    """A Flax-core lifted transform like ``lift.checkpoint`` that applies any :class:`Policy`."""
    from flax.core import lift

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        def rematted(variable_groups, rng_groups, *args, **kwargs):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kwargs)
            return y, repack_fn(scope)

        return call_rematerialized(
            rematted, chosen, (variable_groups, rng_groups, *args), kwargs, prevent_cse=prevent_cse
        )

    return lift.pack(inner, (True,), (True,), (True,), name="remat", enable_kwargs=True)


def _linen(target, chosen: Policy, prevent_cse: bool, methods: tuple[str, ...]):
    from flax.linen import transforms

    lifted = transforms.lift_transform(
        _lift_policy, target, chosen=chosen, prevent_cse=prevent_cse, methods=list(methods)
    )
    if isinstance(target, type):
        # Keep the class name: Linen auto-names submodules after it (``Block_0``), so the
        # decorated class reads the same parameter tree as the undecorated one.
        lifted.__name__ = target.__name__
        lifted.__qualname__ = target.__qualname__
        lifted.__module__ = target.__module__
        lifted.__doc__ = target.__doc__
    return lifted
