"""Transformer ops whose backward pass keeps only their inputs, like fused kernels do.

Plain autodiff of LayerNorm, tanh-GELU, SwiGLU or softmax saves several full-size intermediates
(centered input, tanh output, ...). Megatron-LM's activation accounting assumes fused kernels
that keep only their inputs (one tensor per op; SwiGLU's two, the gate and up projections);
these functions match that by checkpointing the op's internals (elementwise work, cheap to
recompute). Their *outputs* are ordinary values that the surrounding remat policy saves or
recomputes like any other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jremat._engine import lowering as _engine


@_engine.lower_checkpoint
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with statistics in float32; output in ``x.dtype``.

    Args:
      x: input of shape ``[..., features]``.
      scale: ``[features]`` multiplier.
      bias: ``[features]`` offset.
      eps: variance epsilon.
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + eps)
    feature_shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    scale32 = scale.astype(jnp.float32).reshape(feature_shape)
    bias32 = bias.astype(jnp.float32).reshape(feature_shape)
    return (y * scale32 + bias32).astype(x.dtype)


@_engine.lower_checkpoint
def gelu(x: jax.Array) -> jax.Array:
    """tanh-approximate GELU (as in GPT-2); keeps only its input for the backward pass."""
    return jax.nn.gelu(x, approximate=True)


@_engine.lower_checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's gating, ``silu(gate) * up`` (as in LLaMA's and Mixtral's MLPs); keeps only its inputs.

    Args:
      gate: the gate projection's output.
      up: the up projection's output, of ``gate``'s shape.
    """
    return jax.nn.silu(gate) * up


@_engine.lower_checkpoint
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis computed in float32, output in ``x.dtype``; keeps only its input."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)
