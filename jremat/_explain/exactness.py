"""Run a call with and without a policy and say why two results differ (used by :mod:`jremat.testing`).

:class:`Call` takes ``fn(*args, **kwargs)`` apart into NNX graph nodes, arrays and constants and
builds one cached, jitted runner per function; :func:`compare` measures two leaves;
:func:`mismatch_cause` names the likely cause of the first difference.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jremat._engine import jaxpr as _jaxpr
from jremat._engine.cache import BoundedCache

#: Causes a mismatch is attributed to (see :class:`jremat.testing.RematMismatch`).
CAUSE_RANDOM = "a random value drawn differently on recompute"
CAUSE_STATE = "state not written back"
CAUSE_VALUE = "a value that differs"

#: Relative error above which a differing float value is not plain rounding.
ROUNDING_LIMIT = 1e-2


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _is_float(x) -> bool:
    return not _is_key(x) and jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.inexact)


def _graph_node_types() -> tuple:
    # A graph node implies that its program imported Flax: without it, there are none (and no import).
    nnx = sys.modules.get("flax.nnx")
    return () if nnx is None else (nnx.Pytree,)


def _key_text(key) -> str:
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    if isinstance(key, GetAttrKey):
        return "" if key.name == "value" else f".{key.name}"
    if isinstance(key, DictKey):
        return f"[{key.key!r}]"
    if isinstance(key, SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, FlattenedIndexKey):
        return f"[{key.key}]"
    return str(key)


def path_text(path) -> str:
    return "".join(_key_text(k) for k in path)


_RUNNERS = BoundedCache(maxsize=8)


@dataclasses.dataclass
class Call:
    """A call ``fn(*args, **kwargs)`` taken apart into NNX graph nodes, arrays and constants."""

    fn: Callable
    args: tuple
    kwargs: dict
    argnums: tuple[int, ...]
    module_arg: bool  # fn was an NNX module: args[0] is it, always differentiated

    def __post_init__(self):
        node_types = _graph_node_types()
        self.leaves, self.treedef = jax.tree.flatten(
            (self.args, self.kwargs), is_leaf=lambda x: isinstance(x, node_types)
        )
        paths = [
            p
            for p, _ in jax.tree_util.tree_flatten_with_path(
                (self.args, self.kwargs), is_leaf=lambda x: isinstance(x, node_types)
            )[0]
        ]
        self.labels = [self._label(p) for p in paths]
        self.node_pos = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, node_types)]
        self.array_pos = [i for i, leaf in enumerate(self.leaves) if _is_array(leaf)]
        owner = [p[1].idx if p[0].idx == 0 else None for p in paths]  # positional index, or None for kwargs
        self.diff_nodes = [j for j, i in enumerate(self.node_pos) if owner[i] in self.argnums]
        self.diff_arrays = [
            j for j, i in enumerate(self.array_pos) if owner[i] in self.argnums and _is_float(self.leaves[i])
        ]

    def _label(self, path) -> str:
        head, rest = path[0], path[1:]
        if head.idx == 0:
            if self.module_arg and rest[0].idx == 0:
                return "module" + path_text(rest[1:])
            index = rest[0].idx - (1 if self.module_arg else 0)
            return f"args[{index}]" + path_text(rest[1:])
        return "kwargs" + path_text(rest)

    def split(self):
        """``(graphdef, diff_state, other_state, arrays)`` for a pure, jittable call."""
        arrays = [jnp.asarray(self.leaves[i]) for i in self.array_pos]
        if not self.node_pos:
            return None, {}, {}, arrays
        from flax import nnx

        nodes = [self.leaves[i] for i in self.node_pos]
        wanted = set(self.diff_nodes)
        diff_filter = lambda path, value: path[0] in wanted and isinstance(value, nnx.Param)
        graphdef, diff_state, *others = nnx.split(nodes, diff_filter, ...)
        (other_state,) = others  # the state the `...` filter takes
        return graphdef, diff_state, other_state, arrays

    def node_state(self):
        """The NNX state of the graph nodes in the call (``{}`` without any)."""
        if not self.node_pos:
            return {}
        from flax import nnx

        return nnx.state([self.leaves[i] for i in self.node_pos])

    def runner(self, fn: Callable, graphdef) -> Callable:
        """A jitted ``(diff_state, other_state, arrays) -> (out, grads, new_state)`` calling ``fn``.

        Runners are cached on everything they close over, so checking several policies against
        one reference compiles the reference once.
        """
        try:
            key = (
                fn,
                graphdef,
                self.treedef,
                tuple(self.node_pos),
                tuple(self.array_pos),
                tuple(self.diff_arrays),
                tuple(
                    self.leaves[i] if not (i in self.node_pos or i in self.array_pos) else None
                    for i in range(len(self.leaves))
                ),
            )
            hash(key)
        except TypeError:
            return self._runner(fn, graphdef)
        return _RUNNERS.get(key, lambda: self._runner(fn, graphdef))

    def _runner(self, fn: Callable, graphdef) -> Callable:
        merge: Callable[..., Any]
        state: Callable[..., Any]
        if self.node_pos:
            from flax import nnx

            merge, state = nnx.merge, nnx.state
        else:  # no graph nodes: no Flax
            merge, state = (lambda *_: []), (lambda _: {})
        diff_idx = set(self.diff_arrays)

        def run(diff_state, other_state, arrays):
            diff_arrays = [a for j, a in enumerate(arrays) if j in diff_idx]

            def forward(diff_state, diff_arrays, other_state):
                nodes = merge(graphdef, diff_state, other_state)
                full = list(self.leaves)
                for j, i in enumerate(self.node_pos):
                    full[i] = nodes[j]
                it = iter(diff_arrays)
                for j, i in enumerate(self.array_pos):
                    full[i] = next(it) if j in diff_idx else arrays[j]
                args, kwargs = jax.tree.unflatten(self.treedef, full)
                out = fn(*args, **kwargs)
                return out, state(nodes)

            # The other state is a primal too (its cotangent is dropped): NNX only lets a call
            # update variables created at the trace level it runs at.
            out, vjp, new_state = jax.vjp(forward, diff_state, diff_arrays, other_state, has_aux=True)
            grads = vjp(cotangent(out))[:2]
            return out, grads, new_state

        return jax.jit(run)


def cotangent(out):
    """A constant cotangent for ``out``: 1 for scalars, seeded normal draws for arrays, float0 for ints."""
    leaves, treedef = jax.tree.flatten(out)
    cts: list[jax.Array | np.ndarray] = []
    for i, leaf in enumerate(leaves):
        if _is_float(leaf):
            if leaf.ndim == 0:
                cts.append(jnp.ones((), leaf.dtype))
            else:
                draw = jax.random.normal(jax.random.key(1000 + i), leaf.shape, jnp.float32)
                cts.append(draw.astype(leaf.dtype))
        else:
            cts.append(np.zeros(np.shape(leaf), jax.dtypes.float0))
    return jax.tree.unflatten(treedef, cts)


def as_numpy(x) -> np.ndarray:
    if _is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def compare(got, ref, rtol: float, atol: float):
    """``(mismatched, max_abs, max_rel)`` between two leaves; NaNs at the same place are equal."""
    a, b = as_numpy(got), as_numpy(ref)
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size, 1), float("inf"), float("inf")
    if a.dtype == bool or not np.issubdtype(a.dtype, np.number):
        bad = a != b
        return int(np.count_nonzero(bad)), float(np.count_nonzero(bad) > 0), float(np.count_nonzero(bad) > 0)
    a64 = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
    b64 = b.astype(a64.dtype)
    diff = np.abs(a64 - b64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    diff = np.where(both_nan, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    bad = diff > atol + rtol * np.abs(b64)
    bad &= ~both_nan
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(b64))
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float(np.nan_to_num(rel, nan=np.inf).max()) if rel.size else 0.0
    return int(np.count_nonzero(bad)), max_abs, max_rel


def random_primitives(jaxpr) -> set[str]:
    """Names of random primitives used anywhere in ``jaxpr`` (nested jaxprs included)."""
    return {eqn.primitive.name for eqn in _jaxpr.equations(jaxpr) if eqn.primitive.name in _jaxpr.RANDOM_PRIMITIVES}


def mismatch_cause(where, got, ref, initial, max_rel, random_used: set[str]) -> tuple[str, str]:
    """``(cause, explanation)`` for the first mismatch."""
    if where == "state" and initial is not None:
        got_np, ref_np, init_np = as_numpy(got), as_numpy(ref), as_numpy(initial)
        if got_np.shape == init_np.shape and np.array_equal(got_np, init_np) and not np.array_equal(ref_np, init_np):
            return CAUSE_STATE, (
                "the value is still the one before the call, while the call without remat updated it: "
                "the rematerialized call did not write the updated state (an RNG counter, batch "
                "statistics) back to the object passed in; decorate with @jremat.policy, which lifts "
                "NNX state, instead of wrapping a pure function of the state"
            )
    a, b = as_numpy(got), as_numpy(ref)
    one_zero = a.shape == b.shape and np.issubdtype(a.dtype, np.number) and bool(np.any((a == 0) != (b == 0)))
    if random_used and (one_zero or max_rel > ROUNDING_LIMIT):
        return CAUSE_RANDOM, (
            f"the function draws random values ({', '.join(sorted(random_used))}) and "
            + (
                "elements are zero in one result but not the other (a different dropout mask)"
                if one_zero
                else f"the error is not rounding (relative {max_rel:.3g})"
            )
            + ": the recomputation used another key or RNG counter than the forward pass; pass "
            "the key as an argument of the rematerialized function (jremat.dropout, nnx.Rngs "
            "through @jremat.policy, Linen make_rng through a decorated Linen module)"
        )
    if max_rel <= ROUNDING_LIMIT:
        return CAUSE_VALUE, (
            f"relative error {max_rel:.3g} looks like rounding: a saved value kept at lower precision "
            "(a bf16 cast), or XLA fusing the recomputation differently from the forward pass; if "
            "that is acceptable, pass rtol/atol"
        )
    return CAUSE_VALUE, (
        "the rematerialized function computes another value: the policy or wrapper changes what "
        "the backward pass sees (a saved value altered, a different function recomputed)"
    )
