"""Mixture-of-experts FFNs written as users write them: a top-2 softmax router with jitter noise,
tokens sorted by expert, two grouped matmuls (``jax.lax.ragged_dot``) with a GELU between, the
outputs weighted by the renormalized router probabilities and dropped out, in plain JAX
(unrolled and scanned layers), Flax NNX and Equinox; and a SwiGLU variant whose gate and up
projections are one fused grouped matmul split in halves (Megatron-LM's layout). Shapes are tiny:
tests compile them."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import names

# d_model 32: a grouped matmul costs 2 x 32 FLOPs per output element, 16 per byte kept (float32),
# above skip_cheap's default threshold of 8, as at any realistic width.
TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K, LAYERS = 16, 32, 64, 4, 2, 2
JITTER = 0.1
DROPOUT = 0.1


def moe_ffn(
    router, w_in, w_out, x, key, *, tagged: bool = False, grouped_matmul=jax.lax.ragged_dot, gated: bool = False
):
    """One MoE FFN on ``x`` ``[tokens, d_model]``: routing (with jitter noise from ``key``),
    dropless dispatch by sorting, two grouped matmuls (``grouped_matmul(rows, weights,
    group_sizes)``), combine, dropout (from ``key``). ``gated``: the first one's output is split in
    halves, ``silu(gate) * up`` (SwiGLU; ``w_out`` then has half the rows of ``w_in``'s columns)."""
    tag = (lambda v, name: checkpoint_name(v, name)) if tagged else (lambda v, name: v)
    noise = 1.0 + JITTER * jax.random.uniform(jax.random.fold_in(key, 0), x.shape, minval=-1.0, maxval=1.0)
    logits = tag((x * noise) @ router, names.MOE_ROUTER_LOGITS)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
    weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = tag(jnp.repeat(x, TOP_K, axis=0)[order], names.MOE_DISPATCHED)
    group_sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    hidden = tag(grouped_matmul(rows, w_in, group_sizes), names.MOE_HIDDEN_PRE_ACT)
    if gated:
        gate, up = jnp.split(hidden, 2, axis=-1)
        hidden = jax.nn.silu(gate) * up
    else:
        hidden = jax.nn.gelu(hidden)
    hidden = tag(hidden, names.MOE_HIDDEN)
    out = tag(grouped_matmul(hidden, w_out, group_sizes), names.MOE_EXPERT_OUT)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], TOP_K, -1)
    combined = tag(jnp.einsum("tkd,tk->td", unsorted, weights), names.MOE_COMBINED)
    return x + jremat.dropout(combined, DROPOUT, jax.random.fold_in(key, 1), 0)


def params(seed: int = 0, layers: int = LAYERS, gated: bool = False):
    """Stacked parameters ``(router, w_in, w_out)`` of ``layers`` MoE FFNs (``gated``: of :func:`fused_swiglu_ffn`)."""
    hidden = D_FF // 2 if gated else D_FF
    k = jax.random.split(jax.random.key(seed), 3)
    scale = lambda fan_in: 1.0 / jnp.sqrt(fan_in)
    return (
        jax.random.normal(k[0], (layers, D_MODEL, EXPERTS)) * scale(D_MODEL),
        jax.random.normal(k[1], (layers, EXPERTS, D_MODEL, D_FF)) * scale(D_MODEL),
        jax.random.normal(k[2], (layers, EXPERTS, hidden, D_MODEL)) * scale(hidden),
    )


def fused_swiglu_ffn(router, w_gate_up, w_out, x, key):
    """:func:`moe_ffn` with SwiGLU experts whose gate and up projections are one grouped matmul."""
    return moe_ffn(router, w_gate_up, w_out, x, key, gated=True)


def inputs(seed: int = 1):
    """Tokens ``[tokens, d_model]`` and a dropout/jitter key."""
    return jax.random.normal(jax.random.key(seed), (TOKENS, D_MODEL)), jax.random.key(seed + 1)


def unrolled_loss(layer_fn):
    """A loss over :data:`LAYERS` layers in a Python loop, each ``layer_fn(router, w_in, w_out, x, key)``."""

    def loss(stacked, x, key):
        for i in range(LAYERS):
            x = layer_fn(*(p[i] for p in stacked), x, jax.random.fold_in(key, i))
        return jnp.sum(x**2)

    return loss


def scanned_loss(layer_fn):
    """The same loss with the layers under ``lax.scan`` over the stacked parameters."""

    def loss(stacked, x, key):
        def body(h, layer):
            *p, i = layer
            return layer_fn(*p, h, jax.random.fold_in(key, i)), None

        x, _ = jax.lax.scan(body, x, (*stacked, jnp.arange(LAYERS)))
        return jnp.sum(x**2)

    return loss


class NnxMoE(nnx.Module):
    """The FFN as an NNX module with its parameters as ``nnx.Param``."""

    def __init__(self, seed: int = 0):
        router, w_in, w_out = (p[0] for p in params(seed, layers=1))
        self.router, self.w_in, self.w_out = nnx.Param(router), nnx.Param(w_in), nnx.Param(w_out)

    def __call__(self, x, key):
        return moe_ffn(self.router[...], self.w_in[...], self.w_out[...], x, key, tagged=True)


class EqxMoE(eqx.Module):
    """The FFN as an Equinox module."""

    router: jax.Array
    w_in: jax.Array
    w_out: jax.Array

    def __init__(self, seed: int = 0):
        self.router, self.w_in, self.w_out = (p[0] for p in params(seed, layers=1))

    def __call__(self, x, key):
        return moe_ffn(self.router, self.w_in, self.w_out, x, key)


# --- JAX's Pallas grouped matmul (megablox gmm, interpreted on the CPU) ---------------------------

#: The tile sizes of :func:`megablox_gmm`: rows, contracted and output columns per block.
GMM_TILING = (8, 16, 16)


def megablox_gmm(rows, weights, group_sizes):
    """JAX's megablox ``gmm`` kernel (Pallas, ``interpret=True``): a ``grouped_matmul`` for
    :func:`moe_ffn`. Megablox mixes bools and ints, which the suite's strict dtype promotion
    refuses: trace it under the ``megablox_promotion`` fixture."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return gmm(rows, weights, group_sizes, tiling=GMM_TILING, interpret=True)


def gmm_ffn(router, w_in, w_out, x, key):
    """:func:`moe_ffn` with its expert layers as megablox ``gmm`` kernels."""
    return moe_ffn(router, w_in, w_out, x, key, grouped_matmul=megablox_gmm)
