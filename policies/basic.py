"""The simplest policies: ``none``, ``full``, ``dots`` and ``dots_no_batch`` (JAX's dots policies,
with grouped matmuls kept too)."""

from __future__ import annotations

import jax

from jremat import CallbackPolicy, NoRemat, register
from jremat.internal import BUILTIN_PARAMS, GroupedDotsSaveable


@register("none", doc="Save every intermediate: no rematerialization (the function is left unchanged).")
def none_policy() -> NoRemat:
    """Build the ``none`` policy."""
    return NoRemat()


@register("full", doc="Save nothing but the checkpoint's inputs; recompute the whole function in the backward pass.")
def full_policy() -> CallbackPolicy:
    """Build the ``full`` policy."""
    return CallbackPolicy(jax.checkpoint_policies.nothing_saveable)


@register(
    "dots",
    doc="JAX's dots_saveable and grouped matmuls: save the outputs of every dot_general and every grouped "
    "matmul (jax.lax.ragged_dot, or a kernel shaped like one such as megablox gmm: a mixture of experts' expert "
    "matmuls), recompute the rest.",
)
def dots_policy() -> CallbackPolicy:
    """Build the ``dots`` policy."""
    return CallbackPolicy(GroupedDotsSaveable(only_if_no_batch_dims=False))


@register(
    "dots_no_batch",
    doc="JAX's dots_with_no_batch_dims_saveable and grouped matmuls: save matmuls without batch dimensions "
    "(the weight projections, a mixture of experts' grouped matmuls), recompute attention's batched matmuls and "
    "everything else. Under a vmap, as in JAX, a matmul the vmap gives a batch dimension is recomputed; "
    "per_call=true judges each call's own program instead (a pipeline's vmap over stages keeps each stage's matmuls).",
    params=BUILTIN_PARAMS["dots_no_batch"],
)
def dots_no_batch_policy(per_call: bool) -> CallbackPolicy:
    """Build the ``dots_no_batch`` policy (``per_call``: :attr:`jremat.CallbackPolicy.per_call`)."""
    return CallbackPolicy(GroupedDotsSaveable(only_if_no_batch_dims=True), per_call=per_call)
