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
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from jremat._apply import registry
from jremat._apply.decorated_call import (
    _flax_module_types,
    _function,
    _linen,
    _Options,
    call_rematerialized,
    split_static,
)
from jremat._apply.policy import CallbackPolicy, Plan, PlanPolicy, Policy
from jremat._program.program import Program


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
    (:mod:`jremat._engine.tie`), so it saves memory in unrolled code too.

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
            attrs: dict[str, Any] = {m: _function(getattr(target, m), chosen, options) for m in methods}
            attrs.update(__module__=target.__module__, __qualname__=target.__qualname__, __doc__=target.__doc__)
            return type(target.__name__, (target,), attrs)
        if isinstance(target, type) and issubclass(target, _equinox_module_type()):
            _check_methods(target, methods)
            filtered = dataclasses.replace(options, filtered=True)
            eqx_attrs: dict[str, Any] = {m: _function(getattr(target, m), chosen, filtered) for m in methods}
            eqx_attrs.update(__module__=target.__module__, __qualname__=target.__qualname__, __doc__=target.__doc__)
            return type(target)(target.__name__, (target,), eqx_attrs)
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


def _equinox_module_type() -> tuple[type[Any], ...]:
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


_policy_decorator = policy


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
