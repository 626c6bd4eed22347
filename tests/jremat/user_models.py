"""Models written the way users write them, for the decorator tests.

Each model is unrolled (a Python loop over blocks), tags its own tensor names with
``checkpoint_name`` and takes its randomness the way its framework suggests: Linen
``make_rng`` with a legacy ``PRNGKey``, NNX ``Rngs`` stored in the module or passed at call time,
plain functions with a ``uint32`` key. :class:`WmtTransformer` re-types the encoder-decoder of
Flax's ``examples/wmt`` at toy size.

Every builder takes a policy spec (``None``: undecorated) and returns a :class:`Case`: a pure
function of ``(params, key)`` giving the loss, the non-parameter state after the call (RNG
counters, batch statistics) and the parameter gradients, so that they can be compared between
the undecorated and decorated model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat

#: The user's own tensor name every model below tags (one per block).
HIDDEN = "hidden"
WIDTH = 8
N_BLOCKS = 4


@dataclasses.dataclass
class Case:
    """A model ready to differentiate.

    Attributes:
      run: ``(params, key) -> (loss, state, grads)``; ``state`` is the non-parameter state after the call.
      params: the first argument of ``run`` (for NNX models, the whole module state).
      key: the second argument (a PRNG key, or ``None``).
    """

    run: Callable[[Any, Any], tuple[jax.Array, Any, Any]]
    params: Any
    key: Any


def functional_case(loss_and_state, params, key) -> Case:
    """A :class:`Case` from ``(params, key) -> (loss, state)``, differentiated by ``jax.value_and_grad``."""

    def run(params, key):
        (loss, state), grads = jax.value_and_grad(loss_and_state, has_aux=True)(params, key)
        return loss, state, grads

    return Case(run, params, key)


def decorate(spec, target):
    """``target`` decorated with ``@jremat.policy(spec)``, or unchanged for ``spec=None``."""
    return target if spec is None else jremat.policy(spec)(target)


def inputs(batch: int = 2, width: int = WIDTH, seed: int = 7) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, width), jnp.float32)


# --- plain functions -------------------------------------------------------------------------


def plain_block(params, x, key):
    """A GELU MLP block with dropout from a legacy uint32 key."""
    w1, w2 = params
    h = checkpoint_name(jax.nn.gelu(x @ w1), HIDDEN)
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return x + jnp.where(keep, h * 2.0, 0.0) @ w2


def plain_case(spec, *, batch=2, width=WIDTH) -> Case:
    block = plain_block if spec is None else jremat.checkpoint(plain_block, spec)
    keys = jax.random.split(jax.random.PRNGKey(3), N_BLOCKS)  # legacy uint32 keys
    params = [
        (
            jax.random.normal(jax.random.key(i), (width, 4 * width)) / width,
            jax.random.normal(jax.random.key(100 + i), (4 * width, width)) / width,
        )
        for i in range(N_BLOCKS)
    ]
    x = inputs(batch, width)

    def loss_and_state(params, key):
        h = x
        for p, k in zip(params, keys):
            h = block(p, h, k)
        return jnp.sum(jnp.tanh(h)), ()

    return functional_case(loss_and_state, params, None)


# --- Flax Linen ------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    """Dense -> GELU -> Dropout -> Dense with a residual, compact style."""

    @nn.compact
    def __call__(self, x, deterministic: bool):
        h = checkpoint_name(jax.nn.gelu(nn.Dense(4 * x.shape[-1])(x)), HIDDEN)
        h = nn.Dropout(0.5)(h, deterministic=deterministic)
        return x + nn.Dense(x.shape[-1])(h)


class LinenSetupBlock(nn.Module):
    """The same block written setup-style, with ``__call__`` decorated in the class body."""

    def setup(self):
        self.up = nn.Dense(4 * WIDTH)
        self.down = nn.Dense(WIDTH)
        self.drop = nn.Dropout(0.5)

    def __call__(self, x, deterministic: bool):
        h = checkpoint_name(jax.nn.gelu(self.up(x)), HIDDEN)
        return x + self.down(self.drop(h, deterministic=deterministic))


class LinenBatchNormBlock(nn.Module):
    """Dense -> BatchNorm -> ReLU with a residual: batch statistics are mutable state."""

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(x.shape[-1])(x)
        h = checkpoint_name(nn.BatchNorm(use_running_average=not train, momentum=0.5)(h), HIDDEN)
        return x + jax.nn.relu(h)


def linen_case(spec, *, block_cls=LinenBlock, batch=2, width=WIDTH) -> Case:
    block = decorate(spec, block_cls)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            for _ in range(N_BLOCKS):
                x = block()(x, not train) if block_cls is not LinenBatchNormBlock else block()(x, train)
            return x

    model = Model()
    x = inputs(batch, width)
    variables = jax.jit(model.init, static_argnums=2)(jax.random.PRNGKey(0), x, False)
    params = variables["params"]
    extra = {k: v for k, v in variables.items() if k != "params"}

    def loss_and_state(params, key):
        y, updates = model.apply({"params": params, **extra}, x, True, rngs={"dropout": key}, mutable=list(extra))
        return jnp.sum(jnp.tanh(y)), updates

    return functional_case(loss_and_state, params, jax.random.PRNGKey(1))


def linen_setup_case(spec) -> Case:
    block_cls = LinenSetupBlock
    if spec is not None:
        # Decorated in the class body, as a user would write it.
        class Decorated(nn.Module):
            def setup(self):
                self.up = nn.Dense(4 * WIDTH)
                self.down = nn.Dense(WIDTH)
                self.drop = nn.Dropout(0.5)

            @jremat.policy(spec)
            def __call__(self, x, deterministic: bool):
                h = checkpoint_name(jax.nn.gelu(self.up(x)), HIDDEN)
                return x + self.down(self.drop(h, deterministic=deterministic))

        Decorated.__name__ = "LinenSetupBlock"
        block_cls = Decorated
    return linen_case(None, block_cls=block_cls)


# --- Flax NNX --------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    """GELU MLP block whose dropout draws from ``nnx.Rngs`` stored in the module."""

    def __init__(self, width, rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        h = checkpoint_name(jax.nn.gelu(self.up(x)), HIDDEN)
        return x + self.down(self.drop(h))


class NnxCallTimeRngsBlock(nnx.Module):
    """GELU MLP block whose dropout takes ``nnx.Rngs`` at call time (a documented NNX pattern)."""

    def __init__(self, width, rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs):
        h = checkpoint_name(jax.nn.gelu(self.up(x)), HIDDEN)
        return x + self.down(self.drop(h, rngs=rngs))


class NnxAttentionBlock(nnx.Module):
    """Flax's ``nnx.MultiHeadAttention`` with attention dropout from ``nnx.Rngs`` given at call time.

    The input ``[batch, width]`` is attended as one sequence of ``batch`` tokens.
    """

    def __init__(self, width, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=width, qkv_features=width, decode=False, dropout_rate=0.3, rngs=rngs
        )
        self.up = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x, *, rngs):
        h = checkpoint_name(x + self.attn(x, rngs=rngs, deterministic=False), HIDDEN)
        return h + self.up(jax.nn.gelu(h))


class NnxSharedBlock(nnx.Module):
    """A block that uses a projection shared with every other block (tied weights)."""

    def __init__(self, shared: nnx.Linear, width, rngs):
        self.shared = shared
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        h = checkpoint_name(jax.nn.gelu(self.up(self.shared(x))), HIDDEN)
        return x + self.drop(h)[:, : x.shape[-1]]


def _nnx_case(spec, make_blocks, call, width, batch) -> Case:
    """Differentiated the NNX way: ``nnx.value_and_grad`` of the merged module."""
    graphdef, state = nnx.split(make_blocks())
    x = inputs(batch, width)

    def run(state, key):
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(jnp.tanh(call(m, x, key))))(model)
        return loss, nnx.state(model, nnx.Not(nnx.Param)), grads

    return Case(run, state, None)


def nnx_case(spec, *, batch=2, width=WIDTH) -> Case:
    cls = decorate(spec, NnxBlock)

    def make():
        rngs = nnx.Rngs(0, dropout=1)
        return nnx.List([cls(width, rngs) for _ in range(N_BLOCKS)])

    def call(blocks, x, key):
        for b in blocks:
            x = b(x)
        return x

    return _nnx_case(spec, make, call, width, batch)


def nnx_call_time_rngs_case(spec, *, block_cls=None, batch=2, width=WIDTH) -> Case:
    """``block_cls`` blocks (default :class:`NnxCallTimeRngsBlock`) called with the model's ``nnx.Rngs``."""
    cls = decorate(spec, block_cls or NnxCallTimeRngsBlock)

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([cls(width, nnx.Rngs(i)) for i in range(N_BLOCKS)])
            self.rngs = nnx.Rngs(dropout=5)

    def call(model, x, key):
        for b in model.blocks:
            x = b(x, rngs=model.rngs)
        return x

    return _nnx_case(spec, Model, call, width, batch)


def nnx_shared_case(spec, *, batch=2, width=WIDTH) -> Case:
    cls = decorate(spec, NnxSharedBlock)

    def make():
        rngs = nnx.Rngs(0, dropout=1)
        shared = nnx.Linear(width, width, rngs=rngs)
        return nnx.List([cls(shared, width, rngs) for _ in range(N_BLOCKS)])

    def call(blocks, x, key):
        for b in blocks:
            x = b(x)
        return x

    return _nnx_case(spec, make, call, width, batch)


# --- Flax examples/wmt, re-typed at toy size ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WmtConfig:
    vocab_size: int = 16
    emb_dim: int = 8
    num_heads: int = 2
    mlp_dim: int = 16
    num_layers: int = 1
    max_len: int = 6
    dropout_rate: float = 0.3
    attention_dropout_rate: float = 0.3


class WmtMlp(nn.Module):
    config: WmtConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        h = nn.relu(nn.Dense(cfg.mlp_dim)(x))
        h = checkpoint_name(nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic), "wmt_mlp")
        return nn.Dropout(cfg.dropout_rate)(nn.Dense(x.shape[-1])(h), deterministic=deterministic)


class WmtEncoderBlock(nn.Module):
    """Pre-LayerNorm self-attention and MLP, as in examples/wmt's Encoder1DBlock."""

    config: WmtConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        cfg = self.config
        h = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads, dropout_rate=cfg.attention_dropout_rate, deterministic=deterministic
        )(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        return x + WmtMlp(cfg)(nn.LayerNorm()(x), deterministic)


class WmtDecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoding, MLP (EncoderDecoder1DBlock)."""

    config: WmtConfig

    @nn.compact
    def __call__(self, y, encoded, self_mask, cross_mask, deterministic: bool):
        cfg = self.config

        def attention(q, kv, mask):
            return nn.MultiHeadDotProductAttention(
                num_heads=cfg.num_heads, dropout_rate=cfg.attention_dropout_rate, deterministic=deterministic
            )(q, kv, mask=mask)

        h = nn.LayerNorm()(y)
        y = y + nn.Dropout(cfg.dropout_rate)(attention(h, h, self_mask), deterministic=deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(
            attention(nn.LayerNorm()(y), encoded, cross_mask), deterministic=deterministic
        )
        return y + WmtMlp(cfg)(nn.LayerNorm()(y), deterministic)


class WmtTransformer(nn.Module):
    """Shared-embedding encoder-decoder with logits tied to the embedding."""

    config: WmtConfig
    encoder_block: type = WmtEncoderBlock
    decoder_block: type = WmtDecoderBlock

    @nn.compact
    def __call__(self, inputs, targets, train: bool):
        cfg = self.config
        deterministic = not train
        embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))
        positions = self.param("pos", nn.initializers.normal(0.02), (cfg.max_len, cfg.emb_dim))
        src_mask = nn.make_attention_mask(inputs > 0, inputs > 0)
        x = embed(inputs) + positions[None, : inputs.shape[1]]
        for _ in range(cfg.num_layers):
            x = self.encoder_block(cfg)(x, src_mask, deterministic)
        encoded = nn.LayerNorm()(x)
        shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
        self_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0), nn.make_causal_mask(targets))
        cross_mask = nn.make_attention_mask(targets > 0, inputs > 0)
        y = embed(shifted) + positions[None, : targets.shape[1]]
        for _ in range(cfg.num_layers):
            y = self.decoder_block(cfg)(y, encoded, self_mask, cross_mask, deterministic)
        return embed.attend(nn.LayerNorm()(y))


def wmt_case(spec) -> Case:
    cfg = WmtConfig()
    model = WmtTransformer(cfg, decorate(spec, WmtEncoderBlock), decorate(spec, WmtDecoderBlock))
    inputs_ = jnp.array([[3, 5, 7, 2, 0, 0], [4, 4, 9, 11, 13, 2]], jnp.int32)
    targets = jnp.array([[6, 8, 2, 0, 0, 0], [5, 12, 14, 15, 2, 0]], jnp.int32)
    params = jax.jit(model.init, static_argnums=3)(jax.random.PRNGKey(0), inputs_, targets, False)["params"]

    def loss_and_state(params, key):
        logits = model.apply({"params": params}, inputs_, targets, True, rngs={"dropout": key})
        log_probs = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(targets > 0, picked, 0.0)), ()

    return functional_case(loss_and_state, params, jax.random.PRNGKey(2))


#: Every user-style model, by name.
CASES: dict[str, Callable[..., Case]] = {
    "plain": plain_case,
    "linen": linen_case,
    "linen_setup": linen_setup_case,
    "linen_batchnorm": lambda spec: linen_case(spec, block_cls=LinenBatchNormBlock),
    "nnx": nnx_case,
    "nnx_call_time_rngs": nnx_call_time_rngs_case,
    "nnx_attention": lambda spec: nnx_call_time_rngs_case(spec, block_cls=NnxAttentionBlock),
    "nnx_shared": nnx_shared_case,
    "wmt": wmt_case,
}
