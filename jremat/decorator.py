"""``@jremat.policy``: rematerialize a function, a Flax NNX module or a Flax Linen module.

::

    @jremat.policy("every_k", k=4)           # or "every_k:k=4", or a Policy object
    def mlp(w1, w2, x): ...

    @jremat.policy("selective")
    class Block(nnx.Module): ...              # __call__ runs rematerialized

    @jremat.policy("full")
    class Block(nn.Module): ...               # Flax Linen: params and rngs are lifted

Arguments that are not arrays (``deterministic=True``, ints, strings, ``None``) are treated as
static: they are closed over, never traced, so Python control flow on them keeps working (the
equivalent of ``static_argnums`` without having to count arguments).

:func:`custom_policy` registers a user's JAX policy callback (or whole-program plan) under a
name, after which every spec string, decorator and ``--policy`` flag accepts it.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax
import numpy as np

from jremat import registry
from jremat.policy import CallbackPolicy, Plan, PlanPolicy, Policy
from jremat.program import Program


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
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic_positions = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

    def with_dynamic(*dynamic):
        full = list(leaves)
        for i, value in zip(dynamic_positions, dynamic):
            full[i] = value
        a, kw = jax.tree.unflatten(treedef, full)
        return fn(*a, **kw)

    return policy.wrap(with_dynamic, prevent_cse=prevent_cse)(*[leaves[i] for i in dynamic_positions])


def policy(spec: "str | Policy", /, *, methods: Iterable[str] = ("__call__",), prevent_cse: bool = True, **keys):
    """Decorator applying a rematerialization policy to a function or a Flax module.

    Works on:

    1. a plain function of pytrees of arrays;
    2. a Flax NNX module class (its ``methods`` run rematerialized; state updates such as RNG
       counters are written back) or an NNX method (``self`` is an ``nnx.Module``);
    3. a Flax Linen module class or method: variables and RNG streams are lifted like
       ``nn.remat`` does, so ``self.make_rng('dropout')`` draws the same bits when recomputed.

    Args:
      spec: a spec string (``"every_k:k=4"``, ``"every_k"``) or a :class:`Policy`.
      methods: for module classes, the methods to rematerialize.
      prevent_cse: as in ``jax.checkpoint``; ``False`` is safe (and faster) inside ``lax.scan``.
      **keys: policy keys given separately (``k=4``).

    Returns:
      A decorator; it returns a rematerialized function, or a subclass of the module class.

    Raises:
      ValueError: on a bad spec (at decoration time), or when the target is not callable.
    """
    chosen = registry.resolve(spec, **keys)
    methods = tuple(methods)

    def decorate(target):
        from flax import linen, nnx

        if isinstance(target, type) and issubclass(target, linen.Module):
            return _linen(target, chosen, prevent_cse, methods)
        if _is_linen_method(target):
            return _linen(target, chosen, prevent_cse, methods)
        if isinstance(target, type) and issubclass(target, nnx.Module):
            attrs = {m: _function(getattr(target, m), chosen, prevent_cse) for m in methods}
            attrs.update(__module__=target.__module__, __qualname__=target.__qualname__, __doc__=target.__doc__)
            return type(target.__name__, (target,), attrs)
        if callable(target):
            return _function(target, chosen, prevent_cse)
        raise ValueError(f"@jremat.policy needs a function or a Flax module class, got {target!r}")

    return decorate


def _is_linen_method(fn) -> bool:
    """Whether ``fn`` is a Linen method being defined in a class body (``nn.compact`` marks it).

    Other Linen methods are detected when called (their first argument is a ``linen.Module``)
    and rejected with a message, since they can only be lifted at class-definition time.
    """
    return callable(fn) and getattr(fn, "compact", False)


def _function(fn: Callable, chosen: Policy, prevent_cse: bool) -> Callable:
    """Rematerialize a function; if its first argument is an NNX module, lift the module's state."""

    @functools.wraps(fn)
    def rematerialized(*args, **kwargs):
        from flax import linen, nnx

        if args and isinstance(args[0], linen.Module):
            raise ValueError(
                "@jremat.policy on a Linen method must decorate the method inside the class body "
                "of a linen.Module (it is lifted there), or decorate the class itself"
            )
        if args and isinstance(args[0], nnx.Module):
            module, rest = args[0], args[1:]
            graphdef, state = nnx.split(module)

            def pure(state, *a, **kw):
                inner = nnx.merge(graphdef, state)
                out = fn(inner, *a, **kw)
                return out, nnx.state(inner)

            out, new_state = call_rematerialized(pure, chosen, (state, *rest), kwargs, prevent_cse=prevent_cse)
            nnx.update(module, new_state)
            return out
        return call_rematerialized(fn, chosen, args, kwargs, prevent_cse=prevent_cse)

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
        chosen = self.plan_fn(program)
        if not isinstance(chosen, Plan):
            raise ValueError(f"custom plan policy {self.spec!r} returned {chosen!r}, not a jremat.Plan")
        return chosen


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


__all__ = ["call_rematerialized", "custom_policy", "policy"]
