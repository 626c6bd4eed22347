"""The simplest policies: ``none``, ``full``, and JAX's own ``dots`` / ``dots_no_batch``."""

from __future__ import annotations

import jax

from jremat import CallbackPolicy, NoRemat, register


@register("none", doc="Save every intermediate: no rematerialization (the function is left unchanged).")
def none_policy() -> NoRemat:
    """Build the ``none`` policy."""
    return NoRemat()


@register("full", doc="Save nothing but the checkpoint's inputs; recompute the whole function in the backward pass.")
def full_policy() -> CallbackPolicy:
    """Build the ``full`` policy."""
    return CallbackPolicy(jax.checkpoint_policies.nothing_saveable)


@register("dots", doc="JAX's dots_saveable: save the outputs of every dot_general, recompute the rest.")
def dots_policy() -> CallbackPolicy:
    """Build the ``dots`` policy."""
    return CallbackPolicy(jax.checkpoint_policies.dots_saveable)


@register(
    "dots_no_batch",
    doc="JAX's dots_with_no_batch_dims_saveable: save matmuls without batch dimensions (the "
    "weight projections), recompute attention's batched matmuls and everything else.",
)
def dots_no_batch_policy() -> CallbackPolicy:
    """Build the ``dots_no_batch`` policy."""
    return CallbackPolicy(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
