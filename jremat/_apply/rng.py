"""Explicit PRNG-key threading so that dropout is identical when a block is recomputed.

No RNG state lives in the forward pass: a model takes one ``key`` (``None`` means
deterministic), derives one key per layer and one per dropout site from it. Keys are plain
values, so a rematerialized block regenerates bit-identical masks from the key it was given
instead of storing them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_keys(key: jax.Array | None, n_layers: int) -> jax.Array | None:
    """Derive one key per layer, stacked on a leading axis suitable for ``lax.scan``.

    Args:
      key: a typed PRNG key (``jax.random.key``) or ``None``.
      n_layers: number of layers; must be positive.

    Returns:
      A key array of shape ``(n_layers,)`` where entry ``i`` is ``fold_in(key, i)``, or ``None``.

    Raises:
      ValueError: if ``n_layers`` is not positive.
    """
    if n_layers <= 0:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    if key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_layers, dtype=jnp.uint32))


def site_key(key: jax.Array, site_id: int) -> jax.Array:
    """The key of one dropout site inside a layer: ``fold_in(layer_key, site_id)``.

    Args:
      key: the layer's key.
      site_id: a small integer that is unique per dropout site within the layer.
    """
    return jax.random.fold_in(key, site_id)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, site_id: int) -> jax.Array:
    """Inverted dropout whose mask is a pure function of ``(key, site_id)``.

    Args:
      x: the input.
      rate: probability of dropping an element, in ``[0, 1)``.
      key: the layer key, or ``None`` for deterministic (evaluation) mode.
      site_id: the dropout site's id within the layer (see :func:`site_key`).

    Returns:
      ``x`` with dropped elements set to zero and the rest scaled by ``1 / (1 - rate)``;
      ``x`` itself when ``key`` is ``None`` or ``rate`` is 0.

    Raises:
      ValueError: if ``rate`` is outside ``[0, 1)``.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(site_key(key, site_id), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
