"""Attention kernels written in Pallas, recognised by name, and their forward rule made visible.

JAX's Pallas attention kernels (``jax.experimental.pallas.ops.gpu.attention.mha``, whose forward
``pallas_call`` is named ``mha_forward``; the TPU flash and splash kernels) are ``custom_vjp``
functions: the forward rule returns the output and a float32 log-sum-exp to the backward rule,
and the caller sees only the output. No policy can name the log-sum-exp, and under ``jax_remat3``
a ``custom_vjp`` call is recomputed whole, forward rule included, so a checkpointed layer runs
the kernel again in its backward pass.

:func:`split_attention_kernels` rewrites such a call the way
:func:`jremat.attention.blockwise_attention` is built: the forward rule runs in the ordinary
program on gradient-stopped inputs, its residuals (output and log-sum-exp) become ordinary
values a policy can keep, and a ``custom_vjp`` that returns the output feeds them to the
kernel's own backward rule. The values and gradients are the kernel's; only what is visible
to a policy changes. The ``selective`` policy applies it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax import lax
from jax.extend import core as jcore

from jremat import _engine, _jax_compat, _kernel_cost
from jremat._program import nested_jaxprs

#: A ``pallas_call`` whose name holds one of these (lower case) is an attention kernel...
ATTENTION_WORDS = ("mha", "flash", "attention", "splash")
#: ...and a backward one if its name also holds one of these.
BACKWARD_WORDS = ("backward", "bwd", "dq", "dkv", "preprocess")

_CUSTOM_VJP = "custom_vjp_call"


def kernel_name(eqn) -> str | None:
    """The name of a ``pallas_call`` equation (``"mha_forward"``), ``""`` for an unnamed one,
    ``None`` for any other equation."""
    if eqn.primitive.name != "pallas_call":
        return None
    return str(eqn.params.get("name") or "")


def is_attention_forward_kernel(eqn) -> bool:
    """Whether ``eqn`` is an attention forward kernel: a ``pallas_call`` named like one of
    :data:`ATTENTION_WORDS`, or a kernel declared ``attention=True``
    (:func:`jremat.register_kernel`), and named like none of :data:`BACKWARD_WORDS`."""
    name = _kernel_cost.kernel_label(eqn).lower() if _kernel_cost.is_kernel(eqn) else ""
    if any(w in name for w in BACKWARD_WORDS):
        return False
    return _kernel_cost.declared_attention(eqn) or (
        kernel_name(eqn) is not None and any(w in name for w in ATTENTION_WORDS)
    )


def holds_attention_kernel(jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in it (not a kernel body) runs a Pallas attention forward kernel."""
    for eqn in jaxpr.eqns:
        if is_attention_forward_kernel(eqn):
            return True
        if kernel_name(eqn) is None and any(holds_attention_kernel(sub) for sub in nested_jaxprs(eqn)):
            return True
    return False


def _is_kernel_call(eqn) -> bool:
    return eqn.primitive.name == _CUSTOM_VJP and holds_attention_kernel(eqn.params["call_jaxpr"].jaxpr)


def split_attention_kernels(fn: Callable) -> Callable:
    """``fn`` with every ``custom_vjp`` call that runs a Pallas attention forward kernel split
    into its forward rule, in the ordinary program, and its backward rule (module docstring).

    ``fn`` is traced once and its program evaluated (with no such call, as it runs).

    Args:
      fn: a function of pytrees of arrays.

    Returns:
      A function with ``fn``'s values and gradients.
    """

    @functools.wraps(fn)
    def split(*args, **kwargs):
        # The traced program is evaluated, not ``fn`` called again: a second call would draw
        # a Linen module's random values anew (its RNG counter moved on in the trace).
        closed, _, out_tree = _engine.trace_flat(fn, args, kwargs)
        flat = _evaluate_split(closed, jax.tree.leaves((args, kwargs)))
        return jax.tree.unflatten(out_tree, flat)

    return split


def _evaluate_split(closed, flat_args) -> list:
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, flat_args))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = _split_call(eqn, invals) if _is_kernel_call(eqn) else None
        if outs is None:
            outs = _engine.bind_equation(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _split_call(eqn, invals) -> list | None:
    found = _jax_compat.custom_vjp_forward_and_backward(eqn, [lax.stop_gradient(x) for x in invals])
    if found is None:
        return None
    residuals, outs, backward = found

    @jax.custom_vjp
    def with_gradient(ins, res, outs):
        return outs

    def with_gradient_fwd(ins, res, outs):
        return outs, res

    def with_gradient_bwd(res, cts_out):
        # The residuals and outputs are functions of the inputs, whose gradient is all here.
        return list(backward(res, cts_out)), [None] * len(res), [None] * len(cts_out)

    with_gradient.defvjp(with_gradient_fwd, with_gradient_bwd)
    return list(with_gradient(list(invals), list(residuals), outs))
