"""Recompute FLOPs: a traced function priced with the cost model of :func:`jremat._program.equation_flops`.

The FLOPs a policy adds by recomputation are ``program_flops(grad under policy) -
program_flops(grad without remat)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jremat import _program


def jaxpr_flops(jaxpr) -> float:
    """Cost-model FLOPs of a jaxpr (see :func:`jremat._program.equation_flops`).

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: once, its trip
    count being unknown); ``cond`` counts its costliest branch; calls, checkpoints and
    custom-derivative functions count their bodies.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
        elif name == "while":
            total += jaxpr_flops(eqn.params["body_jaxpr"]) + jaxpr_flops(eqn.params["cond_jaxpr"])
        elif name == "cond":
            total += max((jaxpr_flops(b) for b in eqn.params["branches"]), default=0.0)
        else:
            subs = _program.subjaxprs(eqn)
            total += sum(jaxpr_flops(s) for s in subs) if subs else _program.equation_flops(eqn)
    return total


def program_flops(fn: Callable, *args, **kwargs) -> float:
    """Cost-model FLOPs of ``fn(*args, **kwargs)``, traced (not compiled, not run).

    Apply it to ``jax.grad(loss)`` under two policies: the difference is the FLOPs the policy
    spends recomputing.

    Args:
      fn: a function of pytrees of arrays; arguments may be :class:`jax.ShapeDtypeStruct`.
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))


__all__ = ["jaxpr_flops", "program_flops"]
