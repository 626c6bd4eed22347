"""The peers jremat is compared with, on the same model and shapes.

* ``jax.checkpoint`` around the NNX block function, with no policy (JAX's default: save only the
  inputs, as jremat's ``full``) or with JAX's own ``dots_with_no_batch_dims_saveable`` (as
  jremat's ``dots_no_batch``): :class:`JaxCheckpointPeer`.
* ``flax.nnx.remat`` around the same block function: :class:`NnxRematPeer`.
* Linen ``nn.remat`` (blocks unrolled) and ``nn.remat_scan`` (blocks under ``lax.scan``) on
  :class:`LinenGPT`, a small Linen port of :class:`models.GPT` with the same layers, shapes and
  operations (``jremat.ops`` LayerNorm, softmax and GELU; q/k/v/out projections; untied head).

The NNX peers are :class:`jremat.Policy` objects put straight into ``ModelConfig.remat_policy``:
nothing is registered, so they never appear in the policy registry. Every program is compiled by
:func:`jremat.jit` (the same XLA options for every row).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jremat
from jremat import attention, ops
from jremat.models import ModelConfig
from jremat.train.bench.harness import Program


class JaxCheckpointPeer(jremat.Policy):
    """``jax.checkpoint(fn, policy=policy)`` as users write it (no cotangent tie).

    Args:
      policy: a ``jax.checkpoint_policies`` function, or ``None`` (save only the inputs).
      label: how the report names it.
    """

    def __init__(self, policy: Callable | None = None, label: str = "jax.checkpoint"):
        self.jax_policy = policy
        self.label = label

    def checkpoint_untied(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``jax.checkpoint(fn, policy=...)``."""
        return jax.checkpoint(fn, prevent_cse=prevent_cse, policy=self.jax_policy)

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """The peer as users write it: no cotangent tie."""
        return self.checkpoint(fn, prevent_cse=prevent_cse)

    def __repr__(self) -> str:
        return self.label


class NnxRematPeer(jremat.Policy):
    """``flax.nnx.remat(fn)`` with Flax's default policy, around the function that merges the block."""

    label = "nnx.remat"

    def checkpoint_untied(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``nnx.remat(fn)``."""
        return nnx.remat(fn, prevent_cse=prevent_cse)

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """The peer as users write it: no cotangent tie."""
        return self.checkpoint(fn, prevent_cse=prevent_cse)

    def __repr__(self) -> str:
        return self.label


class LinenBlock(nn.Module):
    """:class:`models.gpt.Block` in Linen, without dropout: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Attention follows ``cfg.attention`` as the NNX model does: ``explicit`` (einsum, causal mask,
    softmax, einsum), ``xla`` / ``cudnn`` (``jax.nn.dot_product_attention``) or ``blockwise``
    (:func:`jremat.attention.blockwise_attention`).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        dense = lambda n, name: nn.Dense(n, dtype=dtype, param_dtype=pdtype, name=name)
        batch, seq, _ = x.shape
        inner = cfg.n_heads * cfg.head_dim
        split = lambda t: t.reshape(batch, seq, cfg.n_heads, cfg.head_dim)
        h = _layer_norm(self, "ln1", x, cfg.d_model, pdtype)
        q, k, v = (split(dense(inner, name)(h)) for name in ("q_proj", "k_proj", "v_proj"))
        if cfg.attention == "explicit":
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(1.0 / math.sqrt(cfg.head_dim), x.dtype)
            causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
            probs = ops.softmax(jnp.where(causal, scores, jnp.finfo(x.dtype).min))
            context = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        elif cfg.attention == "blockwise":
            context = attention.blockwise_attention(q, k, v, causal=True, block_size=cfg.attention_block_size)
        else:
            context = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
        context = context.reshape(batch, seq, inner)
        x = x + dense(cfg.d_model, "out_proj")(context)
        h = _layer_norm(self, "ln2", x, cfg.d_model, pdtype)
        return x + dense(cfg.d_model, "fc_out")(ops.gelu(dense(cfg.d_ff, "fc_in")(h)))


def _layer_norm(module: nn.Module, name: str, x, features: int, pdtype):
    scale = module.param(f"{name}_scale", nn.initializers.ones, (features,), pdtype)
    bias = module.param(f"{name}_bias", nn.initializers.zeros, (features,), pdtype)
    return ops.layer_norm(x, scale, bias)


class LinenGPT(nn.Module):
    """:class:`models.GPT` in Linen: embeddings, ``n_layers`` blocks under ``nn.remat`` or ``nn.remat_scan``, head.

    Attributes:
      cfg: the model shapes (dropout must be 0).
      layers: ``"remat"`` (each block ``nn.remat``, unrolled), ``"remat_scan"``, or ``"plain"`` (no remat).
      policy: the ``jax.checkpoint_policies`` function given to Flax (``None``: Flax's default).
    """

    cfg: ModelConfig
    layers: str = "remat_scan"
    policy: Any = None

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=pdtype, name="token_embed")(tokens)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.max_seq_len, cfg.d_model), pdtype)
        x = x + pos[None, : tokens.shape[1]].astype(dtype)
        if self.layers == "plain":
            for i in range(cfg.n_layers):
                x = LinenBlock(cfg, name=f"block_{i}")(x)
        elif self.layers == "remat_scan":
            x = nn.remat_scan(LinenBlock, lengths=(cfg.n_layers,), policy=self.policy)(cfg, name="blocks")(x)
        else:
            for i in range(cfg.n_layers):
                x = nn.remat(LinenBlock, policy=self.policy)(cfg, name=f"block_{i}")(x)
        x = _layer_norm(self, "ln_f", x, cfg.d_model, pdtype)
        return nn.Dense(cfg.vocab_size, dtype=dtype, param_dtype=pdtype, name="head")(x)


def linen_loss(logits, targets):
    """Mean next-token cross-entropy in float32, as :func:`models.cross_entropy_loss`."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)) / targets.size


def linen_program(label: str, cfg: ModelConfig, batch_size: int, layers: str, policy: Any = None) -> Program:
    """The Adam-step :class:`~train.bench.harness.Program` of :class:`LinenGPT` (params and state donated)."""
    if cfg.attn_dropout or cfg.resid_dropout:
        raise ValueError("the Linen port has no dropout: give a config with attn_dropout = resid_dropout = 0")
    model = LinenGPT(cfg, layers, policy)
    tx = optax.adam(1e-3)
    seq = cfg.max_seq_len
    tokens = jax.ShapeDtypeStruct((batch_size, seq), jnp.int32)

    def init_params(seed):
        return model.init(jax.random.key(seed), jnp.zeros((1, seq), jnp.int32))["params"]

    def step(params, opt_state, tok, tgt, key):
        del key  # no dropout
        loss, grads = jax.value_and_grad(lambda p: linen_loss(model.apply({"params": p}, tok), tgt))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def build():
        params = jax.eval_shape(init_params, 0)
        args = (params, jax.eval_shape(tx.init, params), tokens, tokens, jax.eval_shape(lambda: jax.random.key(0)))
        return jremat.jit(step, donate_argnums=(0, 1)), args

    def init(seed):
        params = init_params(seed)
        return params, tx.init(params)

    return Program(label, build, init, cfg.vocab_size, batch_size, seq)


def peer_programs(cfg: ModelConfig, batch_size: int, gpt_program: Callable) -> list[tuple[str, Program]]:
    """Every peer and the jremat policy it is compared with: ``[(jremat spec, peer program), ...]``.

    ``gpt_program(label, cfg, batch)`` builds the NNX programs (:func:`train.bench.harness.gpt_program`).
    The ``full`` comparisons of ``nn.remat`` are against jremat with unrolled layers
    (``scan_layers=False``, spec label ``full (unrolled)``), as ``nn.remat`` runs unrolled.
    """
    no_batch = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return [
        ("full", gpt_program("jax.checkpoint", cfg.replace(remat_policy=JaxCheckpointPeer()), batch_size)),
        (
            "dots_no_batch",
            gpt_program(
                "jax.checkpoint(dots_with_no_batch_dims_saveable)",
                cfg.replace(remat_policy=JaxCheckpointPeer(no_batch, "jax.checkpoint(dots_no_batch)")),
                batch_size,
            ),
        ),
        ("full", gpt_program("nnx.remat", cfg.replace(remat_policy=NnxRematPeer()), batch_size)),
        ("full", linen_program("linen nn.remat_scan", cfg, batch_size, "remat_scan")),
        ("full (unrolled)", linen_program("linen nn.remat", cfg, batch_size, "remat")),
        (
            "dots_no_batch",
            linen_program(
                "linen nn.remat_scan(dots_with_no_batch_dims_saveable)", cfg, batch_size, "remat_scan", no_batch
            ),
        ),
    ]
