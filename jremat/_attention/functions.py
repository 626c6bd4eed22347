"""The implementation of :mod:`jremat.attention` (its public names are re-exported there)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jremat._attention import inputs as _inputs
from jremat._attention.analysis import BLOCKWISE as BLOCKWISE
from jremat._attention.analysis import CUDNN as CUDNN
from jremat._attention.analysis import CUDNN_FORWARD_PRIMITIVES as CUDNN_FORWARD_PRIMITIVES
from jremat._attention.analysis import FORWARD_KINDS as FORWARD_KINDS
from jremat._attention.analysis import FORWARD_SCOPE as FORWARD_SCOPE
from jremat._attention.analysis import PALLAS as PALLAS
from jremat._attention.analysis import count_forward_passes as count_forward_passes
from jremat._attention.analysis import forward_kernel as forward_kernel
from jremat._engine import active as _active_engine
from jremat._spec import names

# Masked scores. Finite, so that a row with no visible key (a padding row) gives no NaN.
_MASKED = float(np.finfo(np.float32).min)


class _Config(NamedTuple):
    """The static parameters of one kernel call (hashable: a ``custom_vjp`` non-differentiable argument)."""

    causal: bool
    block: int
    seq: int
    scale: float
    dropout_rate: float  # 0.0 when there is no dropout key


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    block_size: int = 128,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax self-attention computed block by block, with a memory-efficient custom gradient.

    Equal to :func:`reference_attention` up to float rounding, dropout masks included. It has
    first-order reverse-mode derivatives only (a ``custom_vjp``): ``jax.jvp`` and ``jax.jacfwd``
    through it raise JAX's error for custom_vjp functions, and differentiating its gradient
    (``jax.hessian``, grad of grad) raises ``NotImplementedError``. The
    backward pass keeps ``q``, ``k``, ``v``, the output and a float32 log-sum-exp of shape
    ``[batch, heads, seq]`` (plus the dropout key); it recomputes everything else block by block.

    Args:
      q: queries, ``[batch, seq, heads, head_dim]`` (the layout of ``jax.nn.dot_product_attention``).
      k: keys, the same shape as ``q``.
      v: values, ``[batch, seq, heads, value_dim]``.
      causal: whether query ``i`` sees only keys ``j <= i``. Key blocks entirely after a query
        block are not computed.
      block_size: rows of queries and keys per block. A sequence that is not a multiple of it is
        padded internally (the padded keys are masked); a block larger than the sequence is the
        sequence.
      dropout_rate: probability of dropping an attention probability, in ``[0, 1)``.
      dropout_key: the dropout site's typed threefry key (``jremat.site_key(layer_key, site)``),
        or ``None`` for no dropout. The mask is ``jax.random.bernoulli(dropout_key, 1 - rate,
        (batch, heads, seq, seq))``, drawn one block at a time, never stored.
      scale: multiplier of ``q @ k``; ``1 / sqrt(head_dim)`` if ``None``.

    Returns:
      ``[batch, seq, heads, value_dim]`` in ``q``'s dtype.

    Raises:
      ValueError: if the shapes or dtypes do not match, a dimension is empty, the inputs are
        float64 (x64 on), ``block_size`` is not a positive integer, ``dropout_rate`` is outside
        ``[0, 1)``, ``causal``, ``scale`` or ``dropout_rate`` is traced, or the dropout key is not
        a single threefry2x32 key with ``jax_threefry_partitionable`` on.
      NotImplementedError: when its gradient is differentiated.
    """
    _inputs.check_inputs(q, k, v)
    _inputs.check_not_float64(q)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rate = _inputs.check_rate(dropout_rate)
    seq = q.shape[1]
    if dropout_key is None or rate == 0.0:
        rate, key_data = 0.0, None
    else:
        key_data = _inputs.threefry_key_data(dropout_key)
        batch, _, heads, _ = q.shape
        if batch * heads * seq >= 2**32:
            raise ValueError(
                f"attention dropout needs batch * heads * seq < 2**32, got {batch} * {heads} * {seq}; "
                "split the batch into several calls"
            )
    cfg = _Config(
        causal=_inputs.static_bool(causal, "causal"),
        block=min(int(block_size), seq),
        seq=seq,
        scale=_inputs.scale_or_default(scale, q.shape[-1]),
        dropout_rate=rate,
    )
    return _attention(cfg, q, k, v, key_data)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Explicit softmax attention: full ``[batch, heads, seq, seq]`` scores, float32 softmax (float64
    for float64 inputs),
    inverted dropout on the probabilities, probabilities times values.

    The oracle for :func:`blockwise_attention`, with the same arguments and the same dropout mask:
    ``jax.random.bernoulli(dropout_key, 1 - dropout_rate, (batch, heads, seq, seq))``, which is
    ``jremat.dropout(probs, rate, layer_key, site)`` when ``dropout_key`` is
    ``jremat.site_key(layer_key, site)``.

    Arguments and result are :func:`blockwise_attention`'s, without ``block_size``; float64 inputs
    are computed in float64, and ``scale`` may be traced.

    Raises:
      ValueError: if the shapes or dtypes do not match, a dimension is empty or ``dropout_rate`` is
        outside ``[0, 1)``.
    """
    _inputs.check_inputs(q, k, v)
    rate = _inputs.check_rate(dropout_rate)
    seq = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # may be traced here
    acc = jnp.float64 if jax.dtypes.canonicalize_dtype(q.dtype) == jnp.float64 else jnp.float32
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc) * scale
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), dtype=bool)), scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_key is not None and rate > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - rate, probs.shape)
        probs = jnp.where(keep, probs / jnp.float32(1.0 - rate), jnp.float32(0.0))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=acc)
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# The kernel


def _to_blocks(x, cfg: _Config):
    """``[batch, seq, heads, d]`` -> ``[batch, heads, padded_seq, d]``, zero-padded."""
    x = jnp.swapaxes(x, 1, 2)
    pad = -x.shape[2] % cfg.block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return x


def _visible(cfg: _Config, q_start, k_start):
    """``[block, block]``: which (query, key) pairs of a block attend, or ``None`` if all do."""
    padded = cfg.seq % cfg.block != 0
    if not (cfg.causal or padded):
        return None
    qi = lax.broadcasted_iota(jnp.int32, (cfg.block, cfg.block), 0) + q_start
    kj = lax.broadcasted_iota(jnp.int32, (cfg.block, cfg.block), 1) + k_start
    visible = (qi < cfg.seq) & (kj < cfg.seq)
    return visible & (kj <= qi) if cfg.causal else visible


def _scores(cfg: _Config, q_blk, k_blk, q_start, k_start):
    """Scaled float32 scores ``[batch, heads, block, block]``, masked entries at a large negative."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q_blk, k_blk, preferred_element_type=jnp.float32) * cfg.scale
    visible = _visible(cfg, q_start, k_start)
    return s if visible is None else jnp.where(visible, s, _MASKED)


def _block_keep(cfg: _Config, key_data, batch, heads, q_start, k_start):
    return _inputs.keep_block(
        key_data, cfg.dropout_rate, (batch, heads, cfg.seq, cfg.seq), q_start, k_start, cfg.block, cfg.block
    )


def _block_pairs(cfg: _Config, n_blocks: int, query_major: bool):
    """The (query block, key block) pairs that attend, in loop order, and which pair starts a run.

    Causal attention leaves out the pairs whose key block lies entirely in the query block's
    future. ``query_major``: for each query block its key blocks (the forward pass); otherwise for
    each key block its query blocks (the backward pass). A static list, so the loop over it has a
    known trip count (:func:`_pair_loop`). Returns int32 arrays ``(q, k, first)``.
    """
    pairs = [(qb, kb) for qb in range(n_blocks) for kb in range(n_blocks) if not cfg.causal or kb <= qb]
    if not query_major:
        pairs.sort(key=lambda pair: (pair[1], pair[0]))
    outer = [pair[0] if query_major else pair[1] for pair in pairs]
    first = [i == 0 or outer[i] != outer[i - 1] for i in range(len(pairs))]
    as_array = lambda xs: jnp.asarray(np.asarray(xs, np.int32))
    return as_array([pq for pq, _ in pairs]), as_array([pk for _, pk in pairs]), as_array(first)


def _pair_loop(body, carry, pairs):
    """``body(carry, (q_block, k_block, first))`` over the block pairs, as a ``while`` loop.

    A ``while`` loop, not a ``scan``: a checkpoint policy cannot keep per-iteration values of a
    ``while`` loop (``dots`` would stack every pair's scores: the ``[seq, seq]`` tensor). Its
    trip count is a literal bound on a counter from 0, which :func:`jremat.program_flops` reads,
    so FLOP counts still see every pair.
    """
    n_pairs = int(pairs[0].shape[0])

    def step(state):
        i, inner = state
        return i + 1, body(inner, tuple(p[i] for p in pairs))

    return lax.while_loop(lambda state: state[0] < n_pairs, step, (0, carry))[1]


def _forward(cfg: _Config, q, k, v, key_data):
    """Output ``[batch, seq, heads, value_dim]`` (``q``'s dtype) and float32 log-sum-exp ``[batch, heads, seq]``."""
    batch, seq, heads, _ = q.shape
    qt, kt, vt = (_to_blocks(x, cfg) for x in (q, k, v))
    n_blocks = qt.shape[2] // cfg.block
    inv_keep = jnp.float32(1.0 / (1.0 - cfg.dropout_rate))
    init = (
        jnp.full((batch, heads, cfg.block), -jnp.inf, jnp.float32),
        jnp.zeros((batch, heads, cfg.block), jnp.float32),
        jnp.zeros((batch, heads, cfg.block, vt.shape[-1]), jnp.float32),
    )

    def pair(carry, xs):
        state, out, lse = carry
        qb, kb, first = xs
        m, total, acc = jax.tree.map(lambda a, b: jnp.where(first, a, b), init, state)  # a new query block
        q_start, k_start = qb * cfg.block, kb * cfg.block
        q_blk = lax.dynamic_slice_in_dim(qt, q_start, cfg.block, axis=2)
        k_blk = lax.dynamic_slice_in_dim(kt, k_start, cfg.block, axis=2)
        v_blk = lax.dynamic_slice_in_dim(vt, k_start, cfg.block, axis=2)
        s = _scores(cfg, q_blk, k_blk, q_start, k_start)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        total = total * correction + p.sum(axis=-1)  # the sum of the undropped softmax
        if cfg.dropout_rate:
            keep = _block_keep(cfg, key_data, batch, heads, q_start, k_start)
            p = jnp.where(keep, p * inv_keep, jnp.float32(0.0))
        pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + pv
        # Written at every key block of the query block; the last write is the result.
        out = lax.dynamic_update_index_in_dim(out, (acc / total[..., None]).astype(q.dtype), qb, 0)
        lse = lax.dynamic_update_index_in_dim(lse, m_new + jnp.log(total), qb, 0)
        return (m_new, total, acc), out, lse

    buffers = (
        jnp.zeros((n_blocks, batch, heads, cfg.block, vt.shape[-1]), q.dtype),
        jnp.zeros((n_blocks, batch, heads, cfg.block), jnp.float32),
    )
    with jax.named_scope(FORWARD_SCOPE):
        _, out, lse = _pair_loop(pair, (init, *buffers), _block_pairs(cfg, n_blocks, query_major=True))
    # [blocks, batch, heads, block, d] -> [batch, seq, heads, d]
    out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(batch, n_blocks * cfg.block, heads, -1)[:, :seq]
    lse = jnp.transpose(lse, (1, 2, 0, 3)).reshape(batch, heads, n_blocks * cfg.block)[:, :, :seq]
    return out, lse


def _backward_blocks(cfg: _Config, q, k, v, out, lse, key_data, d_out):
    """``(dq, dk, dv)`` FlashAttention-2 style: for each key block, over the query blocks that see
    it, recomputing probabilities from the saved log-sum-exp."""
    batch, seq, heads, _ = q.shape
    qt, kt, vt, dot = (_to_blocks(x, cfg) for x in (q, k, v, d_out))
    # D = rowsum(dO * O) = rowsum(P * dP), with or without dropout.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [batch, seq, heads]
    delta = _to_blocks(delta[..., None], cfg)[..., 0]
    lse = _to_blocks(lse.transpose(0, 2, 1)[..., None], cfg)[..., 0]  # padding rows are masked
    n_blocks = qt.shape[2] // cfg.block
    inv_keep = jnp.float32(1.0 / (1.0 - cfg.dropout_rate))
    zeros_kv = (
        jnp.zeros((batch, heads, cfg.block, kt.shape[-1]), jnp.float32),
        jnp.zeros((batch, heads, cfg.block, vt.shape[-1]), jnp.float32),
    )

    def pair(carry, xs):
        dq, acc, dk_all, dv_all = carry
        qb, kb, first = xs
        dk, dv = jax.tree.map(lambda a, b: jnp.where(first, a, b), zeros_kv, acc)  # a new key block
        q_start, k_start = qb * cfg.block, kb * cfg.block
        k_blk = lax.dynamic_slice_in_dim(kt, k_start, cfg.block, axis=2)
        v_blk = lax.dynamic_slice_in_dim(vt, k_start, cfg.block, axis=2)
        q_blk, do_blk = (lax.dynamic_slice_in_dim(x, q_start, cfg.block, axis=2) for x in (qt, dot))
        lse_blk, delta_blk = (lax.dynamic_slice_in_dim(x, q_start, cfg.block, axis=2) for x in (lse, delta))
        p = jnp.exp(_scores(cfg, q_blk, k_blk, q_start, k_start) - lse_blk[..., None])
        dp = jnp.einsum("bhqd,bhkd->bhqk", do_blk, v_blk, preferred_element_type=jnp.float32)
        if cfg.dropout_rate:
            keep = _block_keep(cfg, key_data, batch, heads, q_start, k_start)
            p_dropped = jnp.where(keep, p * inv_keep, jnp.float32(0.0))
            dp = jnp.where(keep, dp * inv_keep, jnp.float32(0.0))
        else:
            p_dropped = p
        dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p_dropped.astype(dot.dtype), do_blk, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_blk[..., None])
        dk = dk + cfg.scale * jnp.einsum(
            "bhqk,bhqd->bhkd", ds.astype(qt.dtype), q_blk, preferred_element_type=jnp.float32
        )
        dq_blk = cfg.scale * jnp.einsum(
            "bhqk,bhkd->bhqd", ds.astype(kt.dtype), k_blk, preferred_element_type=jnp.float32
        )
        dq = lax.dynamic_update_slice_in_dim(
            dq, lax.dynamic_slice_in_dim(dq, q_start, cfg.block, axis=2) + dq_blk, q_start, axis=2
        )
        # Written at every query block of the key block; the last write is the result.
        dk_all = lax.dynamic_update_index_in_dim(dk_all, dk, kb, 0)
        dv_all = lax.dynamic_update_index_in_dim(dv_all, dv, kb, 0)
        return dq, (dk, dv), dk_all, dv_all

    carry = (
        jnp.zeros(qt.shape, jnp.float32),
        zeros_kv,
        jnp.zeros((n_blocks, *zeros_kv[0].shape), jnp.float32),
        jnp.zeros((n_blocks, *zeros_kv[1].shape), jnp.float32),
    )
    dq, _, dk, dv = _pair_loop(pair, carry, _block_pairs(cfg, n_blocks, query_major=False))

    def to_input_layout(x, blocked, like):
        if blocked:  # [blocks, batch, heads, block, d]
            x = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(batch, n_blocks * cfg.block, heads, -1)
        else:  # [batch, heads, padded_seq, d]
            x = jnp.swapaxes(x, 1, 2)
        return x[:, :seq].astype(like.dtype)

    return to_input_layout(dq, False, q), to_input_layout(dk, True, k), to_input_layout(dv, True, v)


def _attention(cfg: _Config, q, k, v, key_data):
    # The forward loop runs on gradient-stopped inputs and its results are tagged here, in the
    # primal program, not inside a custom_vjp forward rule: both remat engines then see the tags
    # (jax_remat3 recomputes a custom_vjp call whole, its forward rule included). A
    # checkpoint policy that saves both names drops the forward loop from the backward pass.
    out, lse = _forward(cfg, lax.stop_gradient(q), lax.stop_gradient(k), lax.stop_gradient(v), key_data)
    out = _active_engine.name_tag(out, names.ATTN_CONTEXT)
    lse = _active_engine.name_tag(lse, names.ATTN_LSE)
    return _with_gradient(cfg, q, k, v, out, lse, key_data)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_gradient(cfg: _Config, q, k, v, out, lse, key_data):
    """``out``, whose gradient with respect to ``q``, ``k`` and ``v`` is attention's."""
    return out


def _with_gradient_fwd(cfg: _Config, q, k, v, out, lse, key_data):
    return out, (q, k, v, out, lse, key_data)


def _with_gradient_bwd(cfg: _Config, residuals, d_out):
    q, k, v, out, lse, key_data = residuals
    dq, dk, dv = _first_order_backward(cfg, q, k, v, out, lse, key_data, d_out)
    # out and lse are functions of q, k and v, whose gradient is all above.
    return dq, dk, dv, None, None, None


_with_gradient.defvjp(_with_gradient_fwd, _with_gradient_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_backward(cfg: _Config, q, k, v, out, lse, key_data, d_out):
    return _backward_blocks(cfg, q, k, v, out, lse, key_data, d_out)


@_first_order_backward.defjvp
def _differentiating_the_backward_pass(cfg: _Config, primals, tangents):
    # Differentiating the gradient (jax.hessian, grad of grad, jvp of grad) would treat the saved
    # output and log-sum-exp as constants, since the forward loop runs on gradient-stopped inputs,
    # and give wrong second derivatives; refuse instead.
    raise NotImplementedError(HIGHER_ORDER_MESSAGE)


#: The error that differentiating :func:`blockwise_attention`'s gradient raises.
HIGHER_ORDER_MESSAGE = (
    "blockwise_attention has first-order reverse-mode derivatives only (jax.grad, jax.vjp, "
    "jax.value_and_grad); differentiating its gradient (jax.hessian, jax.grad of jax.grad, "
    "jax.jvp of jax.grad) is not supported: use reference_attention or "
    "jax.nn.dot_product_attention for higher-order derivatives"
)


# ---------------------------------------------------------------------------------------------
# JAX's Pallas flash attention

#: Key and query block of the Pallas kernel's backward pass (JAX's default), at most the forward block.
PALLAS_BACKWARD_BLOCK = 32


def pallas_block_sizes(block_size: int, seq: int):
    """The ``BlockSizes`` :func:`pallas_attention` gives JAX's Pallas kernel for a sequence of ``seq``.

    The forward block is ``min(block_size, seq)``; the backward blocks are at most
    :data:`PALLAS_BACKWARD_BLOCK` and at most the forward block.

    Raises:
      ValueError: if ``block_size`` or ``seq`` is not a positive integer, the forward block is not
        a power of two (Triton's tiles are) or ``seq`` is not a multiple of it.
    """
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes

    for what, value in (("block_size", block_size), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"pallas attention: {what} must be a positive int, got {value!r}")
    block = min(int(block_size), int(seq))
    if block & (block - 1) or seq % block:
        raise ValueError(
            f"pallas attention: the kernel's block min(block_size, seq) = min({block_size}, {seq}) = {block} must be "
            f"a power of two (Triton tiles) that divides the sequence ({seq}); use a power-of-two block size that "
            "divides the sequence (--attention-block-size), or attention 'blockwise', which takes any length"
        )
    backward = min(block, PALLAS_BACKWARD_BLOCK)
    return BlockSizes(
        block_q=block,
        block_k=block,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block_size: int = 128,
    causal: bool = True,
    scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Softmax self-attention by JAX's Pallas flash-attention kernel
    (``jax.experimental.pallas.ops.gpu.attention.mha``), with its own fused backward kernels.

    A ``custom_vjp`` whose forward rule keeps the output and a float32 log-sum-exp returned by
    the forward ``pallas_call`` (named ``mha_forward``), which the caller never sees; the
    ``selective`` policy keeps both (:func:`jremat.kernels.split_attention_kernels`), so the backward pass does not run
    the forward kernel again. No attention dropout.

    Args:
      q: queries, ``[batch, seq, heads, head_dim]``.
      k: keys, the same shape as ``q``.
      v: values, the same shape as ``q`` (the kernel takes one head width).
      block_size: the forward kernel's query and key block (:func:`pallas_block_sizes`).
      causal: whether query ``i`` sees only keys ``j <= i``.
      scale: multiplier of ``q @ k``; ``1 / sqrt(head_dim)`` if ``None``.
      interpret: run the kernel in Pallas's interpreter; ``None`` (default): when JAX's default
        backend is not a GPU (compiled with Triton on a GPU).

    Returns:
      ``[batch, seq, heads, head_dim]`` in ``q``'s dtype.

    Raises:
      ValueError: if the shapes or dtypes do not match, ``v`` has another head width, or the
        block does not suit the sequence (:func:`pallas_block_sizes`).
    """
    from jax.experimental.pallas.ops.gpu.attention import mha

    _inputs.check_inputs(q, k, v)
    if v.shape != q.shape:
        raise ValueError(f"pallas attention needs v of q's shape (one head width), got q {q.shape} and v {v.shape}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return mha(
        q,
        k,
        v,
        None,
        sm_scale=_inputs.scale_or_default(scale, q.shape[-1]),
        causal=_inputs.static_bool(causal, "causal"),
        block_sizes=pallas_block_sizes(block_size, q.shape[1]),
        interpret=bool(interpret),
    )
