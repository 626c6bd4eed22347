"""The one place where rematerialization is applied.

Models describe *where* a checkpoint may go (a whole block, or each sublayer) by passing their
functions through :func:`remat_at`; the :class:`RematConfig` decides which level is active and
with which policy. :func:`run_layers` runs a stack of identical layers under ``lax.scan`` (or
unrolled) with the policy applied per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jremat import registry
from jremat.policy import Policy

GRANULARITIES = ("none", "block", "sublayer")


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """Where and how a layer stack is rematerialized.

    Attributes:
      policy: a policy spec (``"full"``, ``"every_k:k=4"``) or a :class:`Policy`.
      granularity: ``"none"`` (no checkpoint), ``"block"`` (one per layer) or ``"sublayer"``
        (attention and MLP each in their own checkpoint).
      scan_layers: run layers under ``lax.scan`` over stacked parameters (default) instead of
        an unrolled Python loop.
    """

    policy: Any = "full"
    granularity: str = "block"
    scan_layers: bool = True

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"unknown remat granularity {self.granularity!r}; valid: {', '.join(GRANULARITIES)}"
            )
        registry.resolve(self.policy)  # fail at construction on a bad spec

    def resolved_policy(self) -> Policy:
        """The :class:`Policy` object for :attr:`policy`."""
        return registry.resolve(self.policy)


def checkpoint(fn: Callable, policy: "str | Policy" = "full", *, prevent_cse: bool = True, **keys) -> Callable:
    """Rematerialize ``fn`` under a policy: ``jremat.checkpoint(f, "every_k:k=4")``.

    Args:
      fn: a function of pytrees of arrays.
      policy: a spec string or :class:`Policy`.
      prevent_cse: as in ``jax.checkpoint``; use ``False`` inside ``lax.scan``.
      **keys: policy keys given separately, e.g. ``k=4``.

    Returns:
      The checkpointed function, with the same signature as ``fn``.

    Raises:
      ValueError: on a bad policy spec.
    """
    return registry.resolve(policy, **keys).wrap(fn, prevent_cse=prevent_cse)


def remat_at(fn: Callable, level: str, config: RematConfig, *, policy: "Policy | None" = None) -> Callable:
    """Checkpoint ``fn`` if ``level`` is the configured granularity, else return it unchanged.

    Args:
      fn: the block or sublayer function.
      level: ``"block"`` or ``"sublayer"`` — what ``fn`` is.
      config: the :class:`RematConfig`.
      policy: overrides ``config.policy`` (used for per-layer-group policies).

    Raises:
      ValueError: if ``level`` is not ``"block"`` or ``"sublayer"``.
    """
    if level not in ("block", "sublayer"):
        raise ValueError(f"remat level must be 'block' or 'sublayer', got {level!r}")
    if config.granularity != level:
        return fn
    chosen = policy if policy is not None else config.resolved_policy()
    # Inside scan every iteration is its own computation, so CSE across layers cannot undo remat.
    wrapped = chosen.wrap(fn, prevent_cse=not config.scan_layers)
    if config.scan_layers or wrapped is fn:
        return wrapped
    return recompute_after_cotangent(wrapped)


def recompute_after_cotangent(fn: Callable) -> Callable:
    """Make the backward pass of ``fn`` start only once its output cotangent exists.

    In an unrolled program nothing stops XLA's scheduler from running a layer's
    recomputation early, in the forward pass, which keeps every recomputed activation alive
    and undoes the memory saving (XLA:CPU's concurrency-optimized scheduler does exactly
    that). Passing the saved residuals through one ``optimization_barrier`` together with the
    incoming cotangent makes the recomputation data-dependent on the cotangent, so it runs
    where it belongs: just before this layer's backward.

    Args:
      fn: a function (usually already checkpointed) of pytrees of arrays, returning a pytree.

    Returns:
      A function with the same values and gradients.
    """

    @jax.custom_vjp
    def tied(*args):
        return fn(*args)

    def tied_fwd(*args):
        return jax.vjp(fn, *args)

    def tied_bwd(vjp_fn, cotangent):
        residuals, treedef = jax.tree.flatten(vjp_fn)
        residuals, cotangent = jax.lax.optimization_barrier((residuals, cotangent))
        return jax.tree.unflatten(treedef, residuals)(cotangent)

    tied.defvjp(tied_fwd, tied_bwd)
    return tied


def run_layers(
    make_layer_fn: Callable[[Policy], Callable],
    stacked_params: Any,
    x: jax.Array,
    keys: jax.Array | None,
    config: RematConfig,
) -> jax.Array:
    """Run a stack of identical layers, rematerialized per ``config``.

    Args:
      make_layer_fn: ``policy -> layer_fn`` where ``layer_fn(params_i, x, key_i) -> x`` already
        has :func:`remat_at` applied at its block/sublayer boundaries with that policy.
      stacked_params: pytree whose leaves have a leading layer axis.
      x: the activation entering the first layer.
      keys: per-layer keys of shape ``(n_layers,)`` (see :func:`jremat.rng.layer_keys`) or ``None``.
      config: the :class:`RematConfig`.

    Returns:
      The activation after the last layer.
    """
    layer_fn = make_layer_fn(config.resolved_policy())
    n_layers = jax.tree.leaves(stacked_params)[0].shape[0]
    if config.scan_layers:
        def body(carry, layer_inputs):
            params_i, key_i = layer_inputs
            return layer_fn(params_i, carry, key_i), None

        x, _ = jax.lax.scan(body, x, (stacked_params, keys))
        return x
    # One split per leaf: its transpose is one concatenate. Indexing a[i] per layer would
    # transpose into a full-size padded gradient buffer per layer.
    per_layer = jax.tree.map(lambda a: jax.lax.split(a, (1,) * n_layers, axis=0), stacked_params)
    for i in range(n_layers):
        params_i = jax.tree.map(lambda parts: parts[i][0], per_layer, is_leaf=lambda t: isinstance(t, list))
        x = layer_fn(params_i, x, None if keys is None else keys[i])
    return x
