"""Recompute FLOPs: a traced function priced with the cost model of :func:`jremat._program.equation_flops`.

The FLOPs a policy adds by recomputation are ``program_flops(grad under policy) -
program_flops(grad without remat)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax

from jremat import _kernel_cost, _program


def jaxpr_flops(jaxpr) -> float:
    """Cost-model FLOPs of a jaxpr (see :func:`jremat._program.equation_flops`).

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: its trip count
    where the loop counts a counter up by 1 from a literal to a literal bound
    (:func:`while_trip_count`), else once); ``cond`` counts its costliest branch; calls, checkpoints and
    custom-derivative functions count their bodies. A kernel (a ``pallas_call``, an FFI call)
    costs its price (:func:`jremat.kernel_cost`).

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
    """
    return _walk(getattr(jaxpr, "jaxpr", jaxpr), {}, None)


def kernel_body_flops(body, program_ids: tuple[int, ...], grid: tuple[int, ...]) -> float:
    """FLOPs of one run of a Pallas kernel body at grid position ``program_ids``.

    As :func:`jaxpr_flops`, with ``program_id`` and ``num_programs`` known, integer scalars
    computed from them and literals known, and a ``while`` loop between known bounds counted
    for its trip count (a causal kernel's loop over the key blocks at or before its query
    block). Loads and stores of the kernel's blocks (:data:`KERNEL_MEMORY_PRIMITIVES`) cost nothing.

    Args:
      body: the ``pallas_call``'s kernel jaxpr.
      program_ids: the position in the grid, one index per grid axis.
      grid: the grid's extent per axis.
    """
    return _walk(getattr(body, "jaxpr", body), {}, (tuple(program_ids), tuple(grid)))


#: Primitives of a kernel body that move data between a kernel's blocks and memory, or read the
#: grid position: no arithmetic.
KERNEL_MEMORY_PRIMITIVES = frozenset(
    {
        "get",
        "swap",
        "masked_load",
        "masked_swap",
        "load",
        "program_id",
        "num_programs",
        "multiple_of",
        "dma_start",
        "dma_wait",
        "semaphore_read",
        "semaphore_signal",
        "semaphore_wait",
        "delay",
    }
)


def program_id_axes(jaxpr) -> frozenset[int]:
    """The grid axes whose ``program_id`` a kernel body (or a jaxpr nested in it) reads."""
    found = set()
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        current = stack.pop()
        for eqn in current.eqns:
            if eqn.primitive.name == "program_id":
                found.add(int(eqn.params["axis"]))
            stack.extend(_program.nested_jaxprs(eqn))
    return frozenset(found)


def _walk(jaxpr, known: dict, grid_position) -> float:
    """FLOPs of ``jaxpr`` with the scalar values in ``known`` (variable -> int) and, inside a
    kernel body, ``grid_position`` = ``(program_ids, grid)``."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if _kernel_cost.is_kernel(eqn):
            total += cast(_kernel_cost.KernelCost, _kernel_cost.kernel_cost(eqn)).flops
        elif grid_position is not None and name in KERNEL_MEMORY_PRIMITIVES:
            if name in ("program_id", "num_programs"):
                ids, grid = grid_position
                axis = int(eqn.params["axis"])
                table = ids if name == "program_id" else grid
                if axis < len(table):
                    known[eqn.outvars[0]] = int(table[axis])
            continue
        elif name == "scan":
            total += eqn.params["length"] * _walk(eqn.params["jaxpr"].jaxpr, {}, grid_position)
        elif name == "while":
            trips = while_trip_count(eqn, known)
            trips = 1 if trips is None else trips  # an unknown count: once; a known zero: none
            body = _walk(eqn.params["body_jaxpr"].jaxpr, {}, grid_position)
            total += trips * (body + _walk(eqn.params["cond_jaxpr"].jaxpr, {}, grid_position))
        elif name == "cond":
            index = _value(eqn.invars[0], known)
            branches = eqn.params["branches"]
            if index is not None:
                total += _walk(branches[max(0, min(int(index), len(branches) - 1))].jaxpr, {}, grid_position)
            else:
                total += max((_walk(b.jaxpr, {}, grid_position) for b in branches), default=0.0)
        else:
            subs = _program.subjaxprs(eqn)
            if subs:
                total += sum(_walk(sub, _inner_known(eqn, sub, known), grid_position) for sub in subs)
            else:
                total += _program.equation_flops(eqn)
                _fold(eqn, known)
    return total


def _inner_known(eqn, sub, known: dict) -> dict:
    # A call's body takes the call's operands, one for one.
    if len(sub.invars) != len(eqn.invars):
        return {}
    return {inner: value for inner, v in zip(sub.invars, eqn.invars) if (value := _value(v, known)) is not None}


def _value(v, known: dict):
    if _is_literal(v):
        return v.val if getattr(v.aval, "shape", ()) == () else None
    return known.get(v)


def _truncating_div(a, b):
    if b == 0:
        return None
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


#: Integer and boolean scalar arithmetic a kernel computes its loop bounds with.
_FOLDS: dict[str, Callable[..., Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": _truncating_div,
    "rem": lambda a, b: None if b == 0 else a - b * _truncating_div(a, b),
    "max": max,
    "min": min,
    "neg": lambda a: -a,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b,  # bitwise on integers, logical on booleans (as 0 and 1)
    "or": lambda a, b: a | b,
    "select_n": lambda which, *cases: cases[int(which)],
    "convert_element_type": lambda a: a,
    "clamp": lambda lo, x, hi: min(max(x, lo), hi),
}


def _fold(eqn, known: dict) -> None:
    fold = _FOLDS.get(eqn.primitive.name)
    if fold is None or len(eqn.outvars) != 1 or getattr(eqn.outvars[0].aval, "shape", None) != ():
        return
    dtype = getattr(eqn.outvars[0].aval, "dtype", None)
    if dtype is None or not (
        jax.numpy.issubdtype(dtype, jax.numpy.integer) or jax.numpy.issubdtype(dtype, jax.numpy.bool_)
    ):
        return
    values = [_value(v, known) for v in eqn.invars]
    if any(v is None for v in values):
        return
    result = fold(*(int(v) for v in values))
    if result is not None:
        known[eqn.outvars[0]] = int(result)


def while_trip_count(eqn, known: dict | None = None) -> int | None:
    """The trip count of a ``while`` equation of the form ``i = A; while i < B: i += 1`` with ``A``
    and ``B`` known: literals (``lax.while_loop`` over a static range), or values in ``known``
    (variable -> int), a bound ``B`` being a constant of the loop or a value it carries unchanged
    (``lax.fori_loop`` with a computed bound). Else ``None``."""
    known = {} if known is None else known
    cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    counter, bound = cond.eqns[0].invars
    if cond.eqns[0].outvars[0] is not cond.outvars[0] or counter not in cond.invars:
        return None
    position = cond.invars.index(counter) - n_cond
    if position < 0:
        return None
    start = _value(eqn.invars[n_cond + n_body + position], known)
    limit = _loop_bound(eqn, bound, known)
    step = next((e for e in body.eqns if body.outvars[position] in e.outvars), None)
    if start is None or limit is None or step is None or step.primitive.name != "add":
        return None
    if step.invars[0] is not body.invars[n_body + position] or not _is_literal(step.invars[1]):
        return None
    if int(step.invars[1].val) != 1:
        return None
    return max(0, int(limit) - int(start))


def _loop_bound(eqn, bound, known: dict):
    if _is_literal(bound):
        return bound.val
    cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    if bound not in cond.invars:
        return None
    index = cond.invars.index(bound)
    if index < n_cond:
        return _value(eqn.invars[index], known)
    carried = index - n_cond
    if body.outvars[carried] is not body.invars[n_body + carried]:
        return None  # the loop changes its bound
    return _value(eqn.invars[n_cond + n_body + carried], known)


def _is_literal(v) -> bool:
    return isinstance(v, jax.extend.core.Literal)


def program_flops(fn: Callable, *args, **kwargs) -> float:
    """Cost-model FLOPs of ``fn(*args, **kwargs)``, traced (not compiled, not run).

    Apply it to ``jax.grad(loss)`` under two policies: the difference is the FLOPs the policy
    spends recomputing.

    Args:
      fn: a function of pytrees of arrays; arguments may be :class:`jax.ShapeDtypeStruct`.
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))


__all__ = ["jaxpr_flops", "program_flops"]
