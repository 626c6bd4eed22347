"""Kernels jremat did not write, at toy size, and small models that run them.

* :func:`flash` is a ``custom_vjp`` attention kernel written the way users write one: a scan over
  key blocks with an online softmax (running maximum and sum), whose forward rule hands the output
  and a log-sum-exp to its backward rule; no Pallas.
* :func:`pallas` is JAX's Pallas flash attention (``mha``, ``interpret=True``).
* :func:`ffi_kernel` is a ``custom_vjp`` whose rules call FFI targets (``jax.ffi.ffi_call``); it
  traces but cannot run (no target is registered), so it serves jaxpr counts only.

Each model is two attention layers (q, k, v projections, the kernel, a residual), as plain JAX
(:func:`jax_loss`), Flax NNX (:func:`nnx_loss`) and Flax Linen (:func:`linen_loss`), the layers
unrolled or in a ``lax.scan``, each layer checkpointed under a policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax import lax

import jremat
from jremat import attention

B, S, H, D = 1, 16, 2, 8
E = H * D
LAYERS = 2
KEY_BLOCK = 8


@jax.custom_vjp
def flash(q, k, v):
    """Softmax attention ``[batch, seq, heads, head_dim]``, one key block at a time."""
    return _flash_forward(q, k, v)[0]


def _flash_forward(q, k, v):
    b, s, h, d = q.shape
    k_blocks = k.reshape(b, s // KEY_BLOCK, KEY_BLOCK, h, d).swapaxes(0, 1)
    v_blocks = v.reshape(b, s // KEY_BLOCK, KEY_BLOCK, h, d).swapaxes(0, 1)

    def step(carry, kv):
        running_max, running_sum, acc = carry
        k_blk, v_blk = kv
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_blk) / jnp.sqrt(jnp.float32(d))
        new_max = jnp.maximum(running_max, scores.max(-1))
        p = jnp.exp(scores - new_max[..., None])
        correction = jnp.exp(running_max - new_max)
        acc = acc * correction[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, v_blk)
        return (new_max, running_sum * correction + p.sum(-1), acc), None

    init = (jnp.full((b, h, s), -jnp.inf), jnp.zeros((b, h, s)), jnp.zeros((b, h, s, d)))
    (running_max, running_sum, acc), _ = lax.scan(step, init, (k_blocks, v_blocks))
    return (acc / running_sum[..., None]).swapaxes(1, 2), running_max + jnp.log(running_sum)


def _flash_fwd(q, k, v):
    out, lse = _flash_forward(q, k, v)
    return out, (q, k, v, out, lse)


def _flash_bwd(residuals, d_out):
    q, k, v, out, lse = residuals
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    p = jnp.exp(jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale - lse[..., None])
    d_v = jnp.einsum("bhqk,bqhd->bkhd", p, d_out)
    d_p = jnp.einsum("bqhd,bkhd->bhqk", d_out, v)
    d_s = p * (d_p - jnp.sum(d_out * out, -1).swapaxes(1, 2)[..., None]) * scale
    return jnp.einsum("bhqk,bkhd->bqhd", d_s, k), jnp.einsum("bhqk,bqhd->bkhd", d_s, q), d_v


flash.defvjp(_flash_fwd, _flash_bwd)


def pallas(q, k, v):
    """JAX's Pallas flash attention, causal, in Pallas's interpreter."""
    return attention.pallas_attention(q, k, v, causal=True, block_size=KEY_BLOCK, interpret=True)


@jax.custom_vjp
def ffi_kernel(q, k, v):
    """An attention-shaped kernel whose rules call FFI targets (traced only)."""
    return _ffi_forward(q, k, v)[0]


def _ffi_forward(q, k, v):
    lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.ffi.ffi_call("toy_kernel_fwd", (out, lse), vmap_method="sequential")(q, k, v)


def _ffi_fwd(q, k, v):
    out, lse = _ffi_forward(q, k, v)
    return out, (q, k, v, out, lse)


def _ffi_bwd(residuals, d_out):
    q = residuals[0]
    shapes = tuple(jax.ShapeDtypeStruct(q.shape, q.dtype) for _ in range(3))
    return jax.ffi.ffi_call("toy_kernel_bwd", shapes, vmap_method="sequential")(*residuals, d_out)


ffi_kernel.defvjp(_ffi_fwd, _ffi_bwd)

KERNELS = {"flash": flash, "pallas": pallas, "ffi": ffi_kernel}
#: The name each kernel's forward is counted and reported by.
FORWARD_NAMES = {"flash": "flash", "pallas": "mha_forward", "ffi": "toy_kernel_fwd"}


def inputs():
    """``(stacked layer weights [LAYERS, 3, E, E], x [B, S, E])``."""
    w = jax.random.normal(jax.random.key(0), (LAYERS, 3, E, E)) * 0.3
    return w, jax.random.normal(jax.random.key(1), (B, S, E))


# --- plain JAX -------------------------------------------------------------------------------


def jax_layer(attn):
    """One residual attention layer ``(w [3, E, E], x) -> x``."""

    def layer(w, x):
        q, k, v = (jnp.einsum("bse,ef->bsf", x, w[i]).reshape(B, S, H, D) for i in range(3))
        return x + attn(q, k, v).reshape(B, S, E)

    return layer


def jax_loss(attn, spec: str | None, scan: bool):
    """``loss(w, x)`` of :data:`LAYERS` layers, each checkpointed under ``spec`` (``None``: no remat)."""
    layer = jax_layer(attn)
    layer = layer if spec is None else jremat.checkpoint(layer, spec)

    def loss(w, x):
        if scan:
            x, _ = lax.scan(lambda h, wi: (layer(wi, h), None), x, w)
        else:
            for i in range(LAYERS):
                x = layer(w[i], x)
        return jnp.sum(x**2)

    return loss


# --- Flax NNX --------------------------------------------------------------------------------


class NnxAttention(nnx.Module):
    def __init__(self, attn, rngs: nnx.Rngs):
        self.attn = attn
        self.qkv = nnx.Linear(E, 3 * E, use_bias=False, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        return x + self.attn(*(t.reshape(B, S, H, D) for t in (q, k, v))).reshape(B, S, E)


def nnx_loss(attn, spec: str | None, scan: bool):
    """``(loss(state, x), state)``: NNX blocks (the class decorated with ``@jremat.policy(spec)``),
    differentiated with respect to their state; scanned over stacked states or unrolled."""
    cls = NnxAttention if spec is None else jremat.policy(spec)(NnxAttention)
    blocks = [cls(attn, nnx.Rngs(i)) for i in range(LAYERS)]
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    def loss(state, x):
        if scan:
            x, _ = lax.scan(lambda h, s: (nnx.merge(graphdef, s)(h), None), x, state)
        else:
            for i in range(LAYERS):
                x = nnx.merge(graphdef, jax.tree.map(lambda t, i=i: t[i], state))(x)
        return jnp.sum(x**2)

    return loss, stacked


# --- Flax Linen ------------------------------------------------------------------------------


class LinenAttention(nn.Module):
    attn: object

    @nn.compact
    def __call__(self, x):
        q, k, v = jnp.split(nn.Dense(3 * E, use_bias=False)(x), 3, axis=-1)
        return x + self.attn(*(t.reshape(B, S, H, D) for t in (q, k, v))).reshape(B, S, E)


def linen_loss(attn, spec: str | None, scan: bool):
    """``(loss(params, x), params)``: a Linen block (its class decorated with
    ``@jremat.policy(spec)``) applied per layer to stacked parameters, scanned or unrolled."""
    cls = LinenAttention if spec is None else jremat.policy(spec)(LinenAttention)
    block = cls(attn)
    # Initialized through flash (no parameters of its own): the FFI stand-in cannot run.
    x0 = jnp.zeros((B, S, E))
    params = jax.vmap(lambda key: LinenAttention(flash).init(key, x0))(jax.random.split(jax.random.key(2), LAYERS))

    def loss(params, x):
        if scan:
            x, _ = lax.scan(lambda h, p: (block.apply(p, h), None), x, params)
        else:
            for i in range(LAYERS):
                x = block.apply(jax.tree.map(lambda t, i=i: t[i], params), x)
        return jnp.sum(x**2)

    return loss, params


def model(framework: str, kernel: str, spec: str | None, scan: bool):
    """``(loss, params, x)`` of one framework's model running one kernel."""
    attn = KERNELS[kernel]
    w, x = inputs()
    if framework == "jax":
        return jax_loss(attn, spec, scan), w, x
    loss, params = (nnx_loss if framework == "nnx" else linen_loss)(attn, spec, scan)
    return loss, params, x
