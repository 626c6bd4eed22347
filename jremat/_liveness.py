"""Which inputs of a jaxpr its used outputs read, through calls and loops.

JAX's remat3 engine leaves a saved value's recomputation in the backward program as an input
that a ``custom_jvp_call`` ignores (it only supplies a tangent); XLA removes such dead code when
it compiles, so neither the recomputation nor a residual that feeds only it costs anything.
:func:`used_inputs` sees which inputs survive that removal, without compiling.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core as jcore

from jremat import _jax_compat

#: Equations that run one nested jaxpr once, whose inputs and outputs are the equation's own.
CALL_PRIMITIVES = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
)
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _as_jaxpr(value):
    """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr``."""
    return value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value


def call_jaxpr(eqn):
    """The jaxpr a call-like equation runs once with its own inputs and outputs, else ``None``."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for name in _CALL_JAXPR_PARAMS:
        sub = _as_jaxpr(eqn.params.get(name))
        if isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def scan_body_used_outputs(eqn, used_outputs: Sequence[bool]) -> list[bool]:
    """Which outputs of a ``scan`` equation's body are used, given which of the scan's are:
    a carry that the body reads is an output of the previous iteration."""
    body = _as_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = _jax_compat.scan_counts(eqn)
    used_out = list(used_outputs)
    while True:
        used_in = used_inputs(body, used_out)
        grown = False
        for i in range(n_carry):
            if used_in[n_consts + i] and not used_out[i]:
                used_out[i] = grown = True
        if not grown:
            return used_out


def _reads(eqn, used: list[bool]) -> list[bool]:
    if eqn.effects:
        return [True] * len(eqn.invars)
    if (sub := call_jaxpr(eqn)) is not None:
        return used_inputs(sub, used)
    if eqn.primitive.name == "scan":
        return used_inputs(_as_jaxpr(eqn.params["jaxpr"]), scan_body_used_outputs(eqn, used))
    return [True] * len(eqn.invars)


def used_inputs(jaxpr, used_outputs: Sequence[bool] | None = None) -> list[bool]:
    """For each input of ``jaxpr``, whether computing its used outputs reads it.

    Follows call-like equations (``jit``, checkpoints, custom derivatives: their primal jaxpr)
    and ``scan`` bodies (carries to a fixed point); any other equation with nested jaxprs
    (``while``, ``cond``) reads all its inputs when one of its outputs is used. Equations with
    effects are always kept.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      used_outputs: which outputs are used (default: all).

    Returns:
      One bool per input variable of ``jaxpr``.
    """
    jaxpr = _as_jaxpr(jaxpr)
    if used_outputs is None:
        used_outputs = [True] * len(jaxpr.outvars)
    live = {v for v, used in zip(jaxpr.outvars, used_outputs) if used and isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        used = [v in live for v in eqn.outvars]
        if not any(used) and not eqn.effects:
            continue
        live.update(v for v, r in zip(eqn.invars, _reads(eqn, used)) if r and isinstance(v, jcore.Var))
    return [v in live for v in jaxpr.invars]
