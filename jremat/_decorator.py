"""``@jremat.policy``: rematerialize a function, a Flax NNX or Linen module, or an Equinox module.

::

    @jremat.policy("every_k", k=4)           # or "every_k:k=4", or a Policy object
    def mlp(w1, w2, x): ...

    @jremat.policy("selective")
    class Block(nnx.Module): ...              # __call__ runs rematerialized

    @jremat.policy("full")
    class Block(nn.Module): ...               # Flax Linen: params and rngs are lifted

On a plain function the decorator is a drop-in for ``jax.checkpoint``: the same arguments
(``policy`` may also be a JAX policy callable or ``None``; ``prevent_cse`` a bool or a pytree
prefix of the arguments; ``static_argnums``, ``static_argnames``), every other argument traced as JAX traces it
(Python scalars included), the same errors, and one trace per argument structure and avals. On
Flax modules it lifts like ``nnx.remat`` / ``nn.remat``: there, arguments that are not arrays
(``deterministic=True``) are static.

:func:`filter_checkpoint` is the form for Equinox modules and other pytrees of modules, as
``eqx.filter_checkpoint``: every non-array leaf (a dropout rate, ``inference=True``) is static.
``@jremat.policy`` on an ``eqx.Module`` class takes that form for its methods.

:func:`custom_policy` registers a user's JAX policy callback (or whole-program plan) under a
name, after which every spec string, decorator and ``--policy`` flag accepts it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from jremat import registry
from jremat._cache import BoundedCache
from jremat._policy import CallbackPolicy, Plan, PlanPolicy, Policy
from jremat._program import Program


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


def policy(
    spec: str | Policy | Callable | None = None,
    /,
    *,
    methods: Iterable[str] = ("__call__",),
    prevent_cse: bool | Sequence[bool] = True,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Iterable[str] = (),
    **keys,
):
    """Decorator applying a rematerialization policy to a function or a Flax module.

    Works on:

    1. a plain function of pytrees (``staticmethod`` and ``classmethod`` objects included),
       exactly as ``jax.checkpoint`` does (see the module docstring);
    2. a Flax NNX module class (its ``methods`` run rematerialized) or an NNX method. Every NNX
       graph node anywhere in the arguments (modules, ``nnx.Rngs`` passed at call time,
       variables, shared references) behaves as undecorated: state updates such as RNG
       counters are written back, through NNX's own ``split_inputs`` / ``merge_inputs``;
    3. a Flax Linen module class or method (``nn.compact`` or ``setup``-style): variables and
       RNG streams are lifted like ``nn.remat`` does, so ``self.make_rng('dropout')`` draws the
       same bits when recomputed.
    4. an Equinox module class (``eqx.Module``): its ``methods`` run rematerialized as under
       :func:`filter_checkpoint`, every non-array leaf of the module and the arguments static.

    With ``prevent_cse=True`` (the default) the checkpoint is tied to its cotangent
    (:mod:`jremat._tie`), so it saves memory in unrolled code too.

    Args:
      spec: a spec string (``"every_k:k=4"``, ``"every_k"``), a :class:`Policy`, a JAX policy
        callable ``(prim, *avals, **params) -> bool`` (any ``jax.checkpoint_policies`` entry), or
        ``None`` for ``full`` (recompute everything, as ``jax.checkpoint`` without a policy).
      methods: for module classes, the methods to rematerialize.
      prevent_cse: as in ``jax.checkpoint``: a bool, or a tuple whose items are pytree prefixes
        of the positional arguments (after removing static ones), e.g. ``(False, True)`` not to
        guard FSDP-gathered weights; ``False`` only inside a ``lax.scan`` of more than one step.
      static_argnums: as in ``jax.checkpoint``: positions of arguments that are closed over as
        Python values (hashable or not) instead of traced; a new value traces again.
      static_argnames: the same for keyword arguments, by name (as ``jax.checkpoint`` under its
        remat3 engine).
      **keys: policy keys given separately (``k=4``).

    Returns:
      A decorator; it returns a rematerialized function, or a subclass of the module class.

    Raises:
      ValueError: at decoration time, on a bad spec, a layer-stack spec (``nested``), a
        target that is not callable, or a method name the class does not have.
      TypeError: on a ``prevent_cse`` or ``static_argnums`` of the wrong type (as ``jax.checkpoint``).
    """
    chosen = _resolve(spec, keys)
    prevent_cse = _check_prevent_cse(prevent_cse)
    static_argnums = _check_static_argnums(static_argnums)
    static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if not all(isinstance(n, str) for n in static_argnames):
        raise TypeError(f"static_argnames must be a string or strings, got {static_argnames!r}")
    if isinstance(methods, str):
        raise ValueError(f"methods must be a sequence of method names, got the string {methods!r}")
    methods = tuple(methods)
    if not methods or not all(isinstance(m, str) for m in methods):
        raise ValueError(f"methods must be a non-empty sequence of method names, got {methods!r}")
    options = _Options(prevent_cse, static_argnums, static_argnames)

    def decorate(target):
        if isinstance(target, staticmethod):
            return staticmethod(_function(target.__func__, chosen, options))
        if isinstance(target, classmethod):  # the class is static; the caller's positions start after it
            shifted = (0, *(d + 1 if d >= 0 else d for d in options.static_argnums))
            return classmethod(_function(target.__func__, chosen, dataclasses.replace(options, static_argnums=shifted)))
        linen = sys.modules.get("flax.linen")
        if isinstance(target, type) and issubclass(target, _flax_module_types()):
            _check_methods(target, methods)
            if linen is not None and issubclass(target, linen.Module):
                return _linen(target, chosen, options.any_cse, methods)
            attrs = {m: _function(getattr(target, m), chosen, options) for m in methods}
            attrs.update(__module__=target.__module__, __qualname__=target.__qualname__, __doc__=target.__doc__)
            return type(target.__name__, (target,), attrs)
        if isinstance(target, type) and issubclass(target, _equinox_module_type()):
            _check_methods(target, methods)
            filtered = dataclasses.replace(options, filtered=True)
            attrs = {m: _function(getattr(target, m), chosen, filtered) for m in methods}
            attrs.update(__module__=target.__module__, __qualname__=target.__qualname__, __doc__=target.__doc__)
            return type(target)(target.__name__, (target,), attrs)
        if callable(target):
            return _function(target, chosen, options)
        raise ValueError(f"@jremat.policy needs a function or a Flax or Equinox module class, got {target!r}")

    return decorate


def checkpoint(
    fn: Callable,
    policy: str | Policy | Callable | None = None,
    *,
    prevent_cse: bool | Sequence[bool] = True,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Iterable[str] = (),
    **keys,
) -> Callable:
    """Rematerialize ``fn`` under a policy: a drop-in for ``jax.checkpoint`` (``jremat.checkpoint(f, "every_k:k=4")``).

    The same as ``jremat.policy(policy, prevent_cse=..., static_argnums=..., **keys)(fn)``.
    Code written for ``jax.checkpoint(fn, policy=..., prevent_cse=..., static_argnums=...)``
    runs unchanged, with the same values, gradients, errors and trace counts; the one
    difference, the tie to the cotangent that keeps the saving in straight-line code, changes
    no value (docs/policies.md, "jremat.checkpoint and jax.checkpoint").

    Args:
      fn: a function, an NNX/Linen method or module class.
      policy: a spec string, a :class:`Policy`, a JAX policy callable or ``jax.checkpoint_policies``
        entry, or ``None`` (``full``).
      prevent_cse: as in ``jax.checkpoint`` (a bool or a tuple of pytree prefixes).
      static_argnums: as in ``jax.checkpoint``.
      static_argnames: as in ``jax.checkpoint``.
      **keys: policy keys given separately, e.g. ``k=4``.

    Returns:
      The rematerialized function (same signature as ``fn``).

    Raises:
      ValueError: as :func:`policy`.
      TypeError: as :func:`policy`.
    """
    return _policy_decorator(
        policy, prevent_cse=prevent_cse, static_argnums=static_argnums, static_argnames=static_argnames, **keys
    )(fn)


def filter_checkpoint(
    fn: Callable, policy: str | Policy | Callable | None = None, *, prevent_cse: bool = True, **keys
) -> Callable:
    """Rematerialize ``fn`` under a policy with every non-array leaf static, as ``eqx.filter_checkpoint`` does.

    The form for Equinox models and other pytrees of modules: array leaves of ``fn`` and of the
    arguments (``jax.Array``, NumPy arrays and scalars) are the checkpoint's inputs; every other
    leaf (Python ``float`` / ``bool`` / ``int`` fields such as a dropout rate, ``inference=True``,
    functions, strings) is a constant of the trace, so Python code may branch on it. A new static
    value (compared by type and value, or by identity where unhashable) traces again. Of the
    output, likewise, only array leaves leave the checkpoint; the others (a Python ``int``, a
    string, a function) are returned as ``fn`` returned them.

    ``fn`` may itself be a pytree holding arrays (an Equinox module, a bound method of one): its
    arrays are inputs too, and the returned wrapper is a pytree whose one child is ``fn``, so it
    can be a field of a module and ``eqx.partition`` / ``eqx.filter_grad`` see those arrays.
    :func:`checkpoint` is the form with ``jax.checkpoint``'s semantics (Python scalars traced).

    Args:
      fn: a function or callable pytree (``type(block).__call__``, ``block``).
      policy: a spec string, a :class:`Policy`, a JAX policy callable, or ``None`` (``full``).
      prevent_cse: as in ``jax.checkpoint`` (a bool): ``False`` only inside a ``lax.scan`` of more
        than one step.
      **keys: policy keys given separately, e.g. ``k=4``.

    Returns:
      The rematerialized callable (a pytree over ``fn``), called as ``fn`` is.

    Raises:
      ValueError: as :func:`policy`, or on a ``fn`` that is not callable.
      TypeError: on a ``prevent_cse`` that is not a bool.
    """
    if not callable(fn):
        raise ValueError(f"jremat.filter_checkpoint needs a callable (a function or module), got {fn!r}")
    if not isinstance(prevent_cse, bool):
        raise TypeError(f"jremat.filter_checkpoint takes prevent_cse as a bool, got {prevent_cse!r}")
    options = _Options(prevent_cse, (), filtered=True)
    return _FilteredCheckpoint(fn, _function(_call_first, _resolve(policy, keys), options))


def _call_first(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


@jax.tree_util.register_pytree_node_class
class _FilteredCheckpoint:
    """What :func:`filter_checkpoint` returns: a pytree over the wrapped callable, calling it filtered."""

    def __init__(self, fn: Callable, call: Callable):
        self.fn = fn
        self._call = call  # shared by every copy unflattened from this one: one trace cache
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(fn, attribute, None)
            if isinstance(value, str):
                setattr(self, attribute, value)

    def __call__(self, *args, **kwargs):
        return self._call(self.fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"jremat.filter_checkpoint({self.fn!r})"

    def tree_flatten(self):
        return (self.fn,), self._call

    @classmethod
    def tree_unflatten(cls, call, children):
        return cls(children[0], call)


def _equinox_module_type() -> tuple[type, ...]:
    """Equinox's module class if the program has imported Equinox (never imports it)."""
    equinox = sys.modules.get("equinox")
    return (equinox.Module,) if equinox is not None else ()


def _check_methods(target: type, methods: tuple[str, ...]) -> None:
    missing = [m for m in methods if not callable(getattr(target, m, None))]
    if missing:
        found = sorted(n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n, None)))
        raise ValueError(
            f"@jremat.policy: {target.__name__} has no method {', '.join(map(repr, missing))}; "
            f"its methods: __call__, {', '.join(found)}"
        )


def _resolve(spec, keys: dict) -> Policy:
    if spec is None:
        spec = "full"
    if isinstance(spec, (str, Policy)):
        return registry.resolve(spec, **keys)  # refuses a layer-stack spec (nested)
    if callable(spec) and not isinstance(spec, type):
        if keys:
            raise ValueError(
                f"policy keys {sorted(keys)} were given with a JAX policy callable {spec!r}; keys belong to "
                "spec strings such as 'every_k:k=4'"
            )
        return CallbackPolicy(spec)
    raise ValueError(
        f"policy must be a spec string (e.g. 'every_k:k=4'; jremat.available() lists the names), a "
        f"jremat.Policy, a JAX policy callable such as jax.checkpoint_policies.dots_saveable, or None "
        f"(= 'full'); got {spec!r}"
    )


def _check_prevent_cse(prevent_cse) -> bool | tuple:
    """``prevent_cse`` as ``jax.checkpoint`` takes it: a bool, or a sequence made a tuple."""
    if isinstance(prevent_cse, Sequence) and not isinstance(prevent_cse, str):
        return tuple(prevent_cse)
    if not isinstance(prevent_cse, bool):
        raise TypeError(f"prevent_cse must be a bool or tuple of bools, got {type(prevent_cse)=}")
    return prevent_cse


def _check_static_argnums(static_argnums) -> tuple[int, ...]:
    if type(static_argnums) is int:
        return (static_argnums,)
    if isinstance(static_argnums, (tuple, list)) and all(type(d) is int for d in static_argnums):
        return tuple(static_argnums)
    raise TypeError(
        "the `static_argnums` argument to `jax.checkpoint` / `jax.remat` must be an int, tuple of ints or, "
        f"bool, but got value {static_argnums}"
    )


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
        static_out = [None]  # filtered: (out_tree, array positions, leaves) of the output, set by each trace

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


_policy_decorator = policy


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


class _FunctionPlan(PlanPolicy):
    """A :class:`PlanPolicy` whose plan is a user function ``program -> Plan``."""

    def __init__(self, plan_fn: Callable[[Program], Plan]):
        self.plan_fn = plan_fn

    def plan(self, program: Program) -> Plan:
        return self.plan_fn(program)


def custom_policy(name: str, *, doc: str | None = None, kind: str = "callback"):
    """Decorator registering a user's policy under ``name``, usable by name everywhere.

    ``kind="callback"`` (default): the function is a JAX checkpoint-policy callback
    ``(prim, *avals, **params) -> bool`` (``True`` = save), or returning
    ``jax.ad_checkpoint``'s ``Saveable`` / ``Recompute`` / ``Offloadable`` decisions.
    ``kind="plan"``: the function takes the traced :class:`jremat.Program` and returns a
    :class:`jremat.Plan` of equation indices to save or offload.

    ::

        @jremat.custom_policy("save_matmuls_and_exp")
        def keep(prim, *avals, **params):
            return prim.name in ("dot_general", "exp")

    Put such definitions in a module and pass ``--policy-module mypkg.policies`` to the CLIs
    (or call :func:`jremat.load_module`) to use ``--policy save_matmuls_and_exp``.

    Args:
      name: the policy name (letters, digits, underscores).
      doc: what it saves, for ``--help``; defaults to the first line of the function's docstring.
      kind: ``"callback"`` or ``"plan"``.

    Returns:
      A decorator that registers the function and returns it unchanged.

    Raises:
      ValueError: on a malformed or already-registered name, or an unknown ``kind``.
    """
    kinds = ("callback", "plan")
    if kind not in kinds:
        raise ValueError(f"custom_policy kind must be one of {', '.join(kinds)}, got {kind!r}")

    def decorator(fn: Callable) -> Callable:
        if not callable(fn):
            raise ValueError(f"custom_policy {name!r} needs a function, got {fn!r}")
        text = doc or (fn.__doc__ or "").strip().split("\n")[0] or f"custom {kind} policy {fn.__qualname__}"
        if kind == "callback":
            registry.register(name, doc=text)(lambda: CallbackPolicy(fn))
        else:
            registry.register(name, doc=text)(lambda: _FunctionPlan(fn))
        return fn

    return decorator


__all__ = ["call_rematerialized", "checkpoint", "custom_policy", "filter_checkpoint", "policy", "split_static"]
