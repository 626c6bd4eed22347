"""A GPT-style decoder-only language model in Flax NNX, written to be rematerialized.

Read top to bottom: :class:`Attention`, :class:`MLP`, :class:`Block` (pre-LayerNorm), then
:class:`GPT`, which runs its blocks through :func:`jremat.run_layers` (``lax.scan`` over stacked
block parameters by default). The model never chooses a policy: it tags intermediates with the
names in :mod:`jremat.names` and marks its checkpointable pieces with :func:`jremat.remat_at`.

With ``cfg.moe_experts > 0`` each block's MLP is a mixture-of-experts FFN (:class:`models.moe.MoE`,
docs/moe.md), optionally beside a shared dense expert; the router's auxiliary losses reach the
gradient through :func:`models.moe.with_aux_gradient` (the loss stays the cross-entropy), and
:func:`moe_aux_losses` reads their values.

Randomness is explicit: ``GPT.__call__`` takes a ``key`` (``None`` = deterministic); each layer
gets ``fold_in(key, layer)`` and each dropout site ``fold_in(layer_key, site_id)``, so a
recomputed block draws exactly the masks of the original forward pass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import attention, names, ops
from jremat.models.config import ModelConfig
from jremat.models.head import ShardedHead, chunked_summed_loss, summed_token_loss
from jremat.models.moe import ExpertParallel, MoE, with_aux_gradient

# Dropout site ids inside one block; each site's mask comes from fold_in(layer_key, site).
ATTN_DROPOUT_SITE = 0
ATTN_RESID_DROPOUT_SITE = 1
MLP_RESID_DROPOUT_SITE = 2


class LayerNorm(nnx.Module):
    """LayerNorm with f32 statistics whose backward keeps only the input (:func:`jremat.ops.layer_norm`)."""

    def __init__(self, features: int, *, param_dtype):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x):
        return ops.layer_norm(x, self.scale[...], self.bias[...])


class Attention(nnx.Module):
    """Causal multi-head self-attention with separate q/k/v/out projections."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        inner = cfg.n_heads * cfg.head_dim
        dense = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        self.q_proj = nnx.Linear(cfg.d_model, inner, **dense)
        self.k_proj = nnx.Linear(cfg.d_model, inner, **dense)
        self.v_proj = nnx.Linear(cfg.d_model, inner, **dense)
        self.out_proj = nnx.Linear(inner, cfg.d_model, **dense)
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.dropout_rate = cfg.attn_dropout
        self.attention = cfg.attention
        self.block_size = cfg.attention_block_size

    def __call__(self, x, key, hidden_sharding=None):
        """``out_proj(attention(q, k, v))``; ``hidden_sharding`` (or ``None``) is applied to the
        context ``[batch, seq, heads * head_dim]`` that ``out_proj`` contracts."""
        batch, seq, _ = x.shape
        split = lambda t: t.reshape(batch, seq, self.n_heads, self.head_dim)
        q = checkpoint_name(split(self.q_proj(x)), names.QUERY)
        k = checkpoint_name(split(self.k_proj(x)), names.KEY)
        v = checkpoint_name(split(self.v_proj(x)), names.VALUE)
        if self.attention == "blockwise":  # the kernel tags its output attn_context and its statistics attn_lse
            dropout_key = None if key is None else jremat.site_key(key, ATTN_DROPOUT_SITE)
            context = attention.blockwise_attention(
                q,
                k,
                v,
                causal=True,
                block_size=self.block_size,
                dropout_rate=self.dropout_rate,
                dropout_key=dropout_key,
            )
            context = context.reshape(batch, seq, self.n_heads * self.head_dim)
        else:
            if self.attention == "explicit":
                context = self._explicit(q, k, v, key, x.dtype)
            elif self.attention == "pallas":  # the config allows no dropout here
                context = attention.pallas_attention(q, k, v, causal=True, block_size=self.block_size)
            else:  # "xla" or "cudnn" (the config allows no dropout there)
                context = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
            context = checkpoint_name(context.reshape(batch, seq, self.n_heads * self.head_dim), names.ATTN_CONTEXT)
        if hidden_sharding is not None:
            context = hidden_sharding(context)
        return checkpoint_name(self.out_proj(context), names.ATTN_OUT)

    def _explicit(self, q, k, v, key, dtype):
        """einsum, causal mask, softmax, dropout, einsum: every ``[batch, heads, seq, seq]`` tensor tagged."""
        seq = q.shape[1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(1.0 / math.sqrt(self.head_dim), dtype)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = checkpoint_name(jnp.where(causal, scores, jnp.finfo(dtype).min), names.ATTN_SCORES)
        probs = ops.softmax(scores)
        probs = checkpoint_name(jremat.dropout(probs, self.dropout_rate, key, ATTN_DROPOUT_SITE), names.ATTN_PROBS)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class MLP(nnx.Module):
    """Two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dense = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        self.fc_in = nnx.Linear(cfg.d_model, cfg.d_ff, **dense)
        self.fc_out = nnx.Linear(cfg.d_ff, cfg.d_model, **dense)

    def __call__(self, x, hidden_sharding=None):
        """``fc_out(gelu(fc_in(x)))``; ``hidden_sharding`` (or ``None``) is applied to the hidden
        units ``[batch, seq, d_ff]`` that ``fc_out`` contracts."""
        hidden = checkpoint_name(self.fc_in(x), names.MLP_IN)
        hidden = checkpoint_name(ops.gelu(hidden), names.MLP_ACT)
        if hidden_sharding is not None:
            hidden = hidden_sharding(hidden)
        return checkpoint_name(self.fc_out(hidden), names.MLP_OUT)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``.

    With ``cfg.moe_experts > 0`` the MLP is :class:`models.moe.MoE` (attribute ``moe``), plus a
    dense :class:`MLP` every token goes through (attribute ``shared_expert``) with
    ``cfg.moe_shared_expert``; a dense block has the attribute ``mlp``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        param_dtype = jnp.dtype(cfg.param_dtype)
        self.ln1 = LayerNorm(cfg.d_model, param_dtype=param_dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.ln2 = LayerNorm(cfg.d_model, param_dtype=param_dtype)
        if cfg.moe_experts:
            self.moe = MoE(cfg, rngs=rngs)
            if cfg.moe_shared_expert:
                self.shared_expert = MLP(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)
        self.moe_coefs = (cfg.moe_load_balance_coef, cfg.moe_router_z_coef) if cfg.moe_experts else None
        self.resid_dropout = cfg.resid_dropout

    def attention_sublayer(self, x, key, hidden_sharding=None):
        """``x + dropout(attention(ln1(x)))`` (``hidden_sharding``: see :class:`Attention`)."""
        h = checkpoint_name(self.ln1(x), names.LN1_OUT)
        attn = self.attn(h, key, hidden_sharding)
        return x + jremat.dropout(attn, self.resid_dropout, key, ATTN_RESID_DROPOUT_SITE)

    def mlp_sublayer(self, x, key, expert_parallel: ExpertParallel | None = None, hidden_sharding=None):
        """``x + dropout(mlp(ln2(x)))``; with MoE, the router's weighted auxiliary losses join the
        gradient (:func:`models.moe.with_aux_gradient`).

        Args:
          x: the residual stream ``[batch, seq, d_model]``.
          key: the layer's dropout key, or ``None``.
          expert_parallel: the expert-parallel layout of an MoE block on a mesh, or ``None``.
          hidden_sharding: applied to a dense MLP's hidden units (see :class:`MLP`), or ``None``.
        """
        out, aux = self.mlp_sublayer_terms(x, key, expert_parallel, hidden_sharding)
        if aux is None:
            return out
        load_balance, router_z = aux
        lb_coef, z_coef = self.moe_coefs
        return with_aux_gradient(out, lb_coef * load_balance + z_coef * router_z)

    def mlp_sublayer_terms(self, x, key, expert_parallel: ExpertParallel | None = None, hidden_sharding=None):
        """``(x + dropout(ffn(ln2(x))), aux)``: ``aux`` is ``None`` for a dense block, else the
        MoE layer's unweighted ``(load_balance, router_z)`` float32 scalars."""
        h = checkpoint_name(self.ln2(x), names.LN2_OUT)
        if self.moe_coefs is None:
            mlp = self.mlp(h, hidden_sharding)
            return x + jremat.dropout(mlp, self.resid_dropout, key, MLP_RESID_DROPOUT_SITE), None
        ffn, load_balance, router_z = self.moe(h, expert_parallel)
        if hasattr(self, "shared_expert"):
            ffn = ffn + self.shared_expert(h, hidden_sharding)
        return x + jremat.dropout(ffn, self.resid_dropout, key, MLP_RESID_DROPOUT_SITE), (load_balance, router_z)


def make_block_fn(
    graphdef,
    config: jremat.RematConfig,
    policy: jremat.Policy,
    activation_sharding=None,
    weight_sharding=None,
    expert_parallel: ExpertParallel | None = None,
    hidden_sharding=None,
):
    """The pure per-layer function ``(block_params, x, key) -> x`` with remat marked.

    Args:
      graphdef: the NNX graph definition of one :class:`Block`.
      config: where remat goes (block or sublayer).
      policy: the policy for this layer group.
      activation_sharding: ``None`` (default, no-op) or a function ``x -> x`` applied to the
        residual stream ``[batch, seq, d_model]`` at the block input, between the attention and
        MLP sublayers and at the block output, e.g. a ``jax.lax.with_sharding_constraint`` that
        shards it along the sequence axis (sequence parallelism, see ``train.sharding``).
      weight_sharding: ``None`` (default, no-op) or a function ``params -> params`` applied to one
        layer's parameters inside each sublayer's checkpoint, e.g. a sharding constraint to their
        gathered (FSDP-unsharded) placement: the gathered weights are then values of the
        checkpoint, which a policy with ``keep_gathered=true`` keeps for the backward pass instead
        of gathering them again (``train.gathered.GatheredWeights``).
      expert_parallel: ``None`` (default) or, for an MoE model on a mesh with an ``expert`` axis,
        the layout its MoE layers run in (:class:`models.moe.ExpertParallel`).
      hidden_sharding: ``None`` (default, no-op) or a function ``h -> h`` applied to what the
        attention's and the MLP's output projections contract (the context and the hidden units),
        e.g. a sharding constraint that splits them over ``tensor``: the projections are then
        row-parallel in the traced program, and a policy with ``keep_collectives=true`` keeps
        their all-reduced outputs (:func:`jremat._apply.collectives.partial_sum_matmuls`).
    """
    constrain = activation_sharding if activation_sharding is not None else (lambda x: x)
    gather = weight_sharding if weight_sharding is not None else (lambda p: p)

    def attention_part(params, x, key):
        return nnx.merge(graphdef, gather(params)).attention_sublayer(x, key, hidden_sharding)

    def mlp_part(params, x, key):
        return nnx.merge(graphdef, gather(params)).mlp_sublayer(x, key, expert_parallel, hidden_sharding)

    attention_part = jremat.remat_at(attention_part, "sublayer", config, policy=policy)
    mlp_part = jremat.remat_at(mlp_part, "sublayer", config, policy=policy)

    def block(params, x, key):
        x = checkpoint_name(constrain(x), names.BLOCK_INPUT)
        x = constrain(attention_part(params, x, key))
        return checkpoint_name(constrain(mlp_part(params, x, key)), names.BLOCK_OUTPUT)

    return jremat.remat_at(block, "block", config, policy=policy)


class GPT(nnx.Module):
    """Decoder-only LM: embeddings, ``n_layers`` stacked blocks, final LayerNorm, vocabulary head.

    Args:
      cfg: the :class:`ModelConfig`.
      rngs: parameter-initialization RNGs.
      activation_sharding: ``None`` (default) or a hashable function ``x -> x`` applied to the
        residual stream between sublayers (see :func:`make_block_fn`); kept as a static
        attribute, so it is part of the graph definition.
      weight_sharding: ``None`` (default) or a hashable function ``params -> params`` applied to
        each layer's parameters in its sublayers (see :func:`make_block_fn`), likewise static.
      hidden_sharding: ``None`` (default) or a hashable function ``h -> h`` applied to what each
        block's output projections contract (see :func:`make_block_fn`), likewise static.
      sharded_head: ``None`` (default) or, on a mesh, the :class:`models.head.ShardedHead`
        layout the loss's chunks run in (:func:`cross_entropy_loss`), likewise static.
      expert_parallel: ``None`` (default) or the :class:`models.moe.ExpertParallel` layout of an
        MoE model's layers on a mesh with an ``expert`` axis (see :func:`make_block_fn`), likewise static.

    Raises:
      ValueError: an ``expert_parallel`` layout for a dense model.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        activation_sharding=None,
        weight_sharding=None,
        hidden_sharding=None,
        sharded_head: ShardedHead | None = None,
        expert_parallel: ExpertParallel | None = None,
    ):
        if expert_parallel is not None and not cfg.moe_experts:
            raise ValueError("expert_parallel is the layout of an MoE model's experts, but moe_experts is 0")
        self.cfg = cfg
        self.activation_sharding = activation_sharding
        self.weight_sharding = weight_sharding
        self.hidden_sharding = hidden_sharding
        self.sharded_head = sharded_head
        self.expert_parallel = expert_parallel
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.token_embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.pos_embed = nnx.Param(init(rngs.params(), (cfg.max_seq_len, cfg.d_model), param_dtype))
        # One block built n_layers times, stacked on a leading axis for lax.scan.
        block_states = [nnx.state(Block(cfg, rngs=rngs)) for _ in range(cfg.n_layers)]
        graphdef = nnx.graphdef(Block(cfg, rngs=nnx.Rngs(0)))
        self.blocks = nnx.merge(graphdef, jax.tree.map(lambda *leaves: jnp.stack(leaves), *block_states))
        self.ln_f = LayerNorm(cfg.d_model, param_dtype=param_dtype)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Logits of shape ``[batch, seq, vocab]`` (compute dtype).

        Args:
          tokens: int array ``[batch, seq]`` with ``seq <= cfg.max_seq_len``.
          key: a typed PRNG key for dropout, or ``None`` for deterministic evaluation.

        Raises:
          ValueError: if the sequence is longer than ``cfg.max_seq_len``.
        """
        return self.head(self.ln_f(self.hidden(tokens, key)))

    def hidden(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """The residual stream after the last block, ``[batch, seq, d_model]`` (before the final LayerNorm).

        Args and raises as :meth:`__call__`.
        """
        cfg = self.cfg
        x = self.embed(tokens)
        remat = cfg.remat_config()
        graphdef, stacked = nnx.split(self.blocks)
        return jremat.run_layers(
            lambda policy: make_block_fn(
                graphdef,
                remat,
                policy,
                self.activation_sharding,
                self.weight_sharding,
                self.expert_parallel,
                self.hidden_sharding,
            ),
            stacked,
            x,
            jremat.layer_keys(key, cfg.n_layers),
            remat,
        )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token plus position embeddings ``[batch, seq, d_model]``: the first block's input.

        Raises:
          ValueError: if the sequence is longer than ``cfg.max_seq_len``.
        """
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        return self.token_embed(tokens) + self.pos_embed[None, :seq].astype(jnp.dtype(self.cfg.dtype))


def cross_entropy_loss(model: GPT, tokens: jax.Array, targets: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in float32.

    With ``cfg.remat_head_chunks > 0`` the final LayerNorm, head and loss run over that many
    sequence chunks, each recomputed in the backward pass (:func:`jremat.rematerialized_chunks`);
    with a ``model.sharded_head``, every device its own tokens' chunks (:class:`models.head.ShardedHead`).

    Args:
      model: the :class:`GPT`.
      tokens: ``[batch, seq]`` inputs.
      targets: ``[batch, seq]`` next tokens.
      key: dropout key or ``None``.

    Raises:
      ValueError: if ``remat_head_chunks`` does not divide the sequence length (each device's,
        with a ``sharded_head``).
    """
    chunks = model.cfg.remat_head_chunks
    x = model.hidden(tokens, key)
    if chunks == 0:
        total = summed_token_loss(model.head(model.ln_f(x)), targets)
    else:
        head_graphdef, head_params = nnx.split({"ln_f": model.ln_f, "head": model.head})
        if model.sharded_head is None:
            total = chunked_summed_loss(head_graphdef, head_params, x, targets, chunks)
        else:
            total = model.sharded_head.summed_loss(head_graphdef, head_params, x, targets, chunks)
    return total / targets.size


def moe_aux_losses(model: GPT, tokens: jax.Array, key: jax.Array | None = None) -> dict[str, jax.Array]:
    """The router's auxiliary losses of an MoE model on ``tokens``, averaged over the layers.

    The training gradient is that of ``cross_entropy_loss + n_layers * (moe_load_balance_coef *
    load_balance + moe_router_z_coef * router_z)`` with these means (each layer's losses weighted
    and summed, :func:`models.moe.with_aux_gradient`). The blocks run one after the other without
    remat, as the model's forward pass computes them.

    Args:
      model: an MoE :class:`GPT` (``cfg.moe_experts > 0``).
      tokens: ``[batch, seq]`` inputs.
      key: dropout key or ``None``.

    Returns:
      ``{"load_balance": ..., "router_z": ...}``, float32 scalars.

    Raises:
      ValueError: for a dense model, or a sequence longer than ``cfg.max_seq_len``.
    """
    cfg = model.cfg
    if not cfg.moe_experts:
        raise ValueError("moe_aux_losses needs an MoE model (moe_experts > 0)")
    x = model.embed(tokens)
    graphdef, stacked = nnx.split(model.blocks)
    keys = jremat.layer_keys(key, cfg.n_layers)
    totals = [jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)]
    for layer in range(cfg.n_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda leaf, i=layer: leaf[i], stacked))
        layer_key = None if keys is None else keys[layer]
        x = block.attention_sublayer(x, layer_key)
        x, aux = block.mlp_sublayer_terms(x, layer_key, model.expert_parallel)
        totals = [total + term for total, term in zip(totals, aux)]
    return {"load_balance": totals[0] / cfg.n_layers, "router_z": totals[1] / cfg.n_layers}
