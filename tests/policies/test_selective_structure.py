"""``selective`` on models that tag nothing: the attention core found from the program's structure.

Three attentions written the way users write them: Flax's own ``nnx.MultiHeadAttention`` in an
NNX block, Linen's ``nn.MultiHeadDotProductAttention`` in a Linen block, and multi-head attention
in plain ``jnp`` with ``jax.nn.softmax`` (an Equinox-style pure function of a parameter dict).
The sequence is 8x the model width, so the ``[B, H, S, S]`` core dominates.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jremat
from jremat._explain.residuals import ACTIVATION
from jremat._program.program import trace_program
from jremat.policies.selective import BY_STRUCTURE, find_attention_core
from jremat.testing import assert_remat_exact

B, S, D, H = 2, 128, 16, 2
SCORES_ELEMENTS = B * H * S * S


def plain_block(params, x):
    """Multi-head causal self-attention and a tanh MLP in plain JAX (no tags)."""
    q, k, v = (jnp.einsum("bsd,dhe->bhse", x, params[name]) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    context = jnp.einsum("bhqk,bhke->bqhe", probs, v).reshape(x.shape)
    x = x + context @ params["wo"]
    return x + jnp.tanh(x @ params["w1"]) @ params["w2"]


def plain_params(key):
    keys = jax.random.split(key, 6)
    shapes = {
        "wq": (D, H, D // H),
        "wk": (D, H, D // H),
        "wv": (D, H, D // H),
        "wo": (D, D),
        "w1": (D, D),
        "w2": (D, D),
    }
    return {name: 0.2 * jax.random.normal(k, shape) for k, (name, shape) in zip(keys, shapes.items())}


class NnxBlock(nnx.Module):
    """Flax NNX: ``nnx.MultiHeadAttention`` (attention dropout) and a GELU MLP."""

    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=H, in_features=D, qkv_features=D, decode=False, dropout_rate=0.1, rngs=rngs
        )
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x, deterministic=False)
        return x + self.fc(jax.nn.gelu(x))


class LinenBlock(nn.Module):
    """Flax Linen: ``nn.MultiHeadDotProductAttention`` (attention dropout) and a GELU MLP."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1)(x, deterministic=False)
        return x + nn.Dense(D)(jax.nn.gelu(x))


X = jnp.linspace(-1.0, 1.0, B * S * D).reshape(B, S, D)


def _nnx_function():
    graphdef, params, rngs = nnx.split(NnxBlock(nnx.Rngs(0, dropout=1)), nnx.Param, ...)
    return lambda params, x, rngs: nnx.merge(graphdef, params, rngs)(x), (params, X, rngs)


def _linen_function():
    block = LinenBlock()
    variables = block.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X)
    return lambda v, x, key: block.apply(v, x, rngs={"dropout": key}), (variables, X, jax.random.key(2))


MODELS = {
    "plain": lambda: (plain_block, (plain_params(jax.random.key(0)), X)),
    "nnx": _nnx_function,
    "linen": _linen_function,
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_core_is_found_by_structure(model):
    fn, args = MODELS[model]()
    program = trace_program(fn, *args)
    found = find_attention_core(program)
    assert (found.matched_by, found.count) == (BY_STRUCTURE, 1)
    primitives = [program.ops[i].primitive for i in sorted(found.equations)]
    assert primitives[0] == "dot_general" and primitives[-1] == "dot_general"
    assert {"exp", "reduce_sum", "div"} <= set(primitives)
    assert sum(p == "dot_general" for p in primitives) == 2  # scores and probabilities x V, no projection
    assert all(program.ops[i].out_shapes[0] != X.shape for i in found.equations)  # nothing of the MLP


@pytest.mark.parametrize("model", sorted(MODELS))
def test_selective_saves_none_minus_every_scores_sized_tensor(model):
    fn, args = MODELS[model]()
    none = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    selective = jremat.saved_residuals_report(jremat.checkpoint(fn, "selective"), *args, param_argnums=(0,))
    core_sized = [r for r in none.residuals if r.kind == ACTIVATION and math.prod(r.shape) >= SCORES_ELEMENTS]
    assert core_sized, "the model keeps its [B,H,S,S] tensors without remat"
    assert not [r for r in selective.residuals if math.prod(r.shape) >= SCORES_ELEMENTS]
    assert selective.saved_bytes <= none.saved_bytes - sum(r.bytes for r in core_sized)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_selective_gradients_are_exact(model):
    fn, args = MODELS[model]()
    # XLA fuses the recomputed softmax differently from the forward pass: equal to rounding.
    assert_remat_exact(fn, "selective", *args, rtol=1e-4, atol=1e-6)


def _unrolled(fn, spec, n_layers=4):
    block = jremat.checkpoint(fn, spec)

    def loss(first, *rest):
        x = rest[0]
        for _ in range(n_layers):
            x = block(first, x, *rest[1:])
        return jnp.sum(x**2)

    return loss


def _scanned(fn, spec, n_layers=4):
    """The layers under ``lax.scan``, each with its own slice of stacked parameters (and keys)."""
    block = jremat.checkpoint(fn, spec, prevent_cse=False)

    def loss(first, x, *rest):
        stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_layers, *a.shape)), (first, rest))
        x, _ = jax.lax.scan(lambda h, layer: (block(layer[0], h, *layer[1]), None), x, stacked)
        return jnp.sum(x**2)

    return loss


def _nnx_module_step(spec, n_layers=4):
    """The NNX way: the module itself passed to the checkpointed call, ``nnx.grad`` of the loss."""
    graphdef, state = nnx.split(NnxBlock(nnx.Rngs(0, dropout=1)))
    block = jremat.checkpoint(lambda module, x: module(x), spec)

    def step(state, x):
        def loss(module):
            h = x
            for _ in range(n_layers):
                h = block(module, h)
            return jnp.sum(h**2)

        return nnx.grad(loss)(nnx.merge(graphdef, state))

    return step, (state, X)


def _step(model, layout, spec):
    if model == "nnx" and layout is _unrolled:
        return _nnx_module_step(spec)
    fn, args = MODELS[model]()
    return jax.grad(layout(fn, spec)), args


LAYOUTS = [(model, layout) for model in sorted(MODELS) for layout in (_unrolled, _scanned)]


@pytest.mark.parametrize("model, layout", LAYOUTS, ids=[f"{m}-{f.__name__[1:]}" for m, f in LAYOUTS])
@pytest.mark.heavy
def test_selective_compiled_temp_is_at_most_0_8_of_none(model, layout):
    temp = {}
    for spec in ("none", "selective"):
        step, args = _step(model, layout, spec)
        temp[spec] = jremat.memory_report(step, *args).temp_bytes
    assert temp["selective"] <= 0.8 * temp["none"], temp


def test_an_exp_without_softmax_is_no_attention():
    """A matmul, ``exp`` and another matmul (no sum, no division) is an MLP, not attention."""
    w = jnp.eye(4) * 0.5
    mlp = lambda w, x: jnp.exp(x @ w) @ w
    assert find_attention_core(trace_program(mlp, w, jnp.ones((2, 4)))).matched_by is None
    with pytest.raises(jremat.PolicyDoesNotApply, match="no attention core"):
        jax.grad(lambda w: jnp.sum(jremat.checkpoint(mlp, "selective")(w, jnp.ones((2, 4)))))(w)


def test_a_softmax_inside_a_custom_jvp_call_is_found():
    """``jax.nn.softmax`` traced as one custom-derivative call still delimits the core."""

    @jax.custom_jvp
    def softmax(s):
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        return e / jnp.sum(e, axis=-1, keepdims=True)

    softmax.defjvp(lambda primals, tangents: jax.jvp(jax.nn.softmax, primals, tangents))
    fn = lambda q, k, v: softmax(q @ k.T) @ v
    q = jnp.ones((8, 4))
    program = trace_program(fn, q, q, q)
    found = find_attention_core(program)
    assert found.matched_by == BY_STRUCTURE
    assert any(program.ops[i].primitive == "custom_jvp_call" for i in found.equations)
