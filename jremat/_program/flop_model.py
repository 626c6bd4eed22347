"""The FLOP cost model of equations and jaxprs, a kernel priced by the function the caller passes.

Every function here that may meet a kernel (a ``pallas_call``, an FFI call) takes
``kernel_flops``: a function from an equation to the FLOPs of one call of it if it is a kernel,
``None`` for any other equation. jremat's price is :func:`jremat._program.kernel_cost.kernel_flops`, and
:mod:`jremat._program.flops` is this model with that price; :mod:`jremat._program.kernel_cost` prices a
``pallas_call`` by its body here (:func:`kernel_body_flops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from jremat._engine import jaxpr as _jaxpr

#: FLOPs of one call of a kernel equation, ``None`` for an equation that is no kernel.
KernelFlops = Callable[[Any], float | None]


def equation_flops(eqn, kernel_flops: KernelFlops) -> float:
    """Cost-model FLOPs to recompute one equation's outputs from its inputs.

    ``dot_general``: 2 x batch x free(lhs) x free(rhs) x contracted. A grouped matmul
    (``ragged_dot_general``): the work done, 2 x output elements x contracted, divided by the
    number of groups where the ragged dimension is contracted (the output then has a group
    dimension, and each row enters one group's product only). ``conv``: 2 x output
    elements x kernel elements / output features. Reductions: input elements. Nested
    checkpoint / custom-derivative calls: the sum over their body; a ``scan``: its body times
    its length. Shape-only ops: 0.
    ``dynamic_update_slice``: one per element written (the update; XLA writes in place).
    A kernel (a ``pallas_call``, an FFI call): ``kernel_flops(eqn)``.
    Everything else (elementwise): one FLOP per output element.

    Args:
      eqn: a jaxpr equation.
      kernel_flops: the price of a kernel equation (module docstring).
    """
    priced = kernel_flops(eqn)
    if priced is not None:
        return priced
    name = eqn.primitive.name
    if name in _jaxpr.SHAPE_ONLY_PRIMITIVES:
        return 0.0
    if name == _jaxpr.DOT_GENERAL:
        (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if name == _jaxpr.RAGGED_DOT_GENERAL:
        return ragged_dot_flops(eqn)
    if name == _jaxpr.CONV:
        rhs_shape = eqn.invars[1].aval.shape
        out_features = rhs_shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs_shape) / out_features
    subs = _jaxpr.subjaxprs(eqn)
    if subs:
        # A scan's outputs cost its body times its length (a while loop's count is unknown: once).
        trips = eqn.params["length"] if name == _jaxpr.SCAN else 1
        return float(trips * sum(equation_flops(e, kernel_flops) for sub in subs for e in sub.eqns))
    if name == _jaxpr.DYNAMIC_UPDATE_SLICE:
        return float(math.prod(eqn.invars[1].aval.shape))
    if name.startswith(_jaxpr.REDUCE_PREFIX) or name in _jaxpr.REDUCTION_PRIMITIVES:
        return float(sum(math.prod(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")))
    return float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))


def ragged_dot_flops(eqn) -> float:
    """The work of a grouped matmul equation (``ragged_dot_general``), in every dimension layout a
    gradient produces: 2 x rows x contracted x free in total, not per group.

    The forward ``[m, k] x [g, k, n] -> [m, n]`` and the input's gradient ``[m, n] x [g, k, n] ->
    [m, k]`` cost 2 x output elements x contracted; the weight's gradient ``[m, k] x [m, n] ->
    [g, k, n]`` contracts the ragged dimension ``m``, whose rows each enter one group's product:
    2 x output elements x contracted / g.
    """
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = numbers.dot_dimension_numbers
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    flops = 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if set(numbers.lhs_ragged_dimensions) & set(lhs_contract):
        flops /= max(eqn.invars[2].aval.shape[0], 1)  # the group sizes: one per group
    return flops


def jaxpr_flops(jaxpr, kernel_flops: KernelFlops) -> float:
    """Cost-model FLOPs of a jaxpr (:func:`equation_flops` per equation).

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: its trip count
    where the loop counts a counter up by 1 from a literal to a literal bound
    (:func:`while_trip_count`), else once); ``cond`` counts its costliest branch; calls, checkpoints and
    custom-derivative functions count their bodies. A kernel costs ``kernel_flops(eqn)``.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      kernel_flops: the price of a kernel equation (module docstring).
    """
    return _walk(getattr(jaxpr, "jaxpr", jaxpr), {}, None, kernel_flops)


def kernel_body_flops(body, program_ids: tuple[int, ...], grid: tuple[int, ...], kernel_flops: KernelFlops) -> float:
    """FLOPs of one run of a Pallas kernel body at grid position ``program_ids``.

    As :func:`jaxpr_flops`, with ``program_id`` and ``num_programs`` known, integer scalars
    computed from them and literals known, and a ``while`` loop between known bounds counted
    for its trip count (a causal kernel's loop over the key blocks at or before its query
    block). Loads and stores of the kernel's blocks (:data:`jremat._engine.jaxpr.KERNEL_MEMORY_PRIMITIVES`) cost nothing.

    Args:
      body: the ``pallas_call``'s kernel jaxpr.
      program_ids: the position in the grid, one index per grid axis.
      grid: the grid's extent per axis.
      kernel_flops: the price of a kernel equation the body holds (module docstring).
    """
    return _walk(getattr(body, "jaxpr", body), {}, (tuple(program_ids), tuple(grid)), kernel_flops)


def program_id_axes(jaxpr) -> frozenset[int]:
    """The grid axes whose ``program_id`` a kernel body (or a jaxpr nested in it) reads."""
    return frozenset(
        int(eqn.params["axis"]) for eqn in _jaxpr.equations(jaxpr) if eqn.primitive.name == _jaxpr.PROGRAM_ID
    )


def _walk(jaxpr, known: dict, grid_position, kernel_flops: KernelFlops) -> float:
    """FLOPs of ``jaxpr`` with the scalar values in ``known`` (variable -> int) and, inside a
    kernel body, ``grid_position`` = ``(program_ids, grid)``."""

    def walk(sub, sub_known: dict) -> float:
        return _walk(sub, sub_known, grid_position, kernel_flops)

    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if (priced := kernel_flops(eqn)) is not None:
            total += priced
        elif grid_position is not None and name in _jaxpr.KERNEL_MEMORY_PRIMITIVES:
            if name in (_jaxpr.PROGRAM_ID, _jaxpr.NUM_PROGRAMS):
                ids, grid = grid_position
                axis = int(eqn.params["axis"])
                table = ids if name == _jaxpr.PROGRAM_ID else grid
                if axis < len(table):
                    known[eqn.outvars[0]] = int(table[axis])
            continue
        elif name == _jaxpr.SCAN:
            total += eqn.params["length"] * walk(eqn.params["jaxpr"].jaxpr, {})
        elif name == _jaxpr.WHILE:
            trips = while_trip_count(eqn, known)
            trips = 1 if trips is None else trips  # an unknown count: once; a known zero: none
            body = walk(eqn.params["body_jaxpr"].jaxpr, {})
            total += trips * (body + walk(eqn.params["cond_jaxpr"].jaxpr, {}))
        elif name == _jaxpr.COND:
            index = _value(eqn.invars[0], known)
            branches = eqn.params["branches"]
            if index is not None:
                total += walk(branches[max(0, min(int(index), len(branches) - 1))].jaxpr, {})
            else:
                total += max((walk(b.jaxpr, {}) for b in branches), default=0.0)
        else:
            subs = _jaxpr.subjaxprs(eqn)
            if subs:
                total += sum(walk(sub, _inner_known(eqn, sub, known)) for sub in subs)
            else:
                total += equation_flops(eqn, kernel_flops)
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


def _fold(eqn, known: dict) -> None:
    fold = _jaxpr.INTEGER_SCALAR_FUNCTIONS.get(eqn.primitive.name)
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
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != _jaxpr.LESS_THAN:
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
    if start is None or limit is None or step is None or step.primitive.name != _jaxpr.ADD:
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
