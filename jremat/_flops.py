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

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: its trip count
    where the loop counts a counter up by 1 from a literal to a literal bound
    (:func:`while_trip_count`), else once); ``cond`` counts its costliest branch; calls, checkpoints and
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
            trips = while_trip_count(eqn) or 1
            total += trips * (jaxpr_flops(eqn.params["body_jaxpr"]) + jaxpr_flops(eqn.params["cond_jaxpr"]))
        elif name == "cond":
            total += max((jaxpr_flops(b) for b in eqn.params["branches"]), default=0.0)
        else:
            subs = _program.subjaxprs(eqn)
            total += sum(jaxpr_flops(s) for s in subs) if subs else _program.equation_flops(eqn)
    return total


def while_trip_count(eqn) -> int | None:
    """The trip count of a ``while`` equation of the form ``i = A; while i < B: i += 1`` with ``A``
    and ``B`` literals (``lax.while_loop`` over a static range), else ``None``."""
    cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    counter, bound = cond.eqns[0].invars
    if cond.eqns[0].outvars[0] is not cond.outvars[0] or not _is_literal(bound) or counter not in cond.invars:
        return None
    position = cond.invars.index(counter) - n_cond
    start = eqn.invars[n_cond + n_body + position]
    step = next((e for e in body.eqns if body.outvars[position] in e.outvars), None)
    if position < 0 or not _is_literal(start) or step is None or step.primitive.name != "add":
        return None
    if step.invars[0] is not body.invars[n_body + position] or not _is_literal(step.invars[1]):
        return None
    if int(step.invars[1].val) != 1:
        return None
    return max(0, int(bound.val) - int(start.val))


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
