"""Recompute FLOPs: the cost model of :mod:`jremat._program.flop_model` with kernels priced by :func:`jremat.kernel_cost`.

The FLOPs a policy adds by recomputation are ``program_flops(grad under policy) -
program_flops(grad without remat)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jremat._program import flop_model as _flop_model
from jremat._program import kernel_cost as _kernel_cost


def equation_flops(eqn) -> float:
    """Cost-model FLOPs to recompute one equation's outputs from its inputs
    (:func:`jremat._program.flop_model.equation_flops`); a kernel (a ``pallas_call``, an FFI call) costs
    its price (:func:`jremat.kernel_cost`).

    Args:
      eqn: a jaxpr equation.
    """
    return _flop_model.equation_flops(eqn, _kernel_cost.kernel_flops)


def jaxpr_flops(jaxpr) -> float:
    """Cost-model FLOPs of a jaxpr (see :func:`equation_flops`).

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: its trip count
    where the loop counts a counter up by 1 from a literal to a literal bound
    (:func:`jremat._program.flop_model.while_trip_count`), else once); ``cond`` counts its costliest branch; calls, checkpoints and
    custom-derivative functions count their bodies. A kernel (a ``pallas_call``, an FFI call)
    costs its price (:func:`jremat.kernel_cost`).

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
    """
    return _flop_model.jaxpr_flops(jaxpr, _kernel_cost.kernel_flops)


def program_flops(fn: Callable, *args, **kwargs) -> float:
    """Cost-model FLOPs of ``fn(*args, **kwargs)``, traced (not compiled, not run).

    Apply it to ``jax.grad(loss)`` under two policies: the difference is the FLOPs the policy
    spends recomputing.

    Args:
      fn: a function of pytrees of arrays; arguments may be :class:`jax.ShapeDtypeStruct`.
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))


__all__ = ["jaxpr_flops", "program_flops"]
