"""Exact saved sets of the built-in policies on small known functions (JAX's saved_residuals)."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat.attention import blockwise_attention, count_forward_passes
from jremat.models import preset
from jremat.models.gpt import Block, make_block_fn
from tests.conftest import saved_residuals
from tests.policies.helpers import program_of, residual_bytes, saved_op_indices


def sin_chain(x):
    """Eight compute ops: seven chained sines (each needs its input) and a final sum."""
    for _ in range(7):
        x = jnp.sin(x)
    return jnp.sum(x)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_every_k_saves_exactly_ops_0_k_2k(k):
    x = jnp.linspace(0.1, 1.0, 6)
    prog = program_of(sin_chain, x)
    compute = prog.compute_ops
    assert [op.primitive for op in compute] == ["sin"] * 7 + ["reduce_sum"]
    saved, others = saved_op_indices(jremat.checkpoint(sin_chain, f"every_k:k={k}"), x)
    # Sines 0..5 feed a sine whose backward needs them; sine 6 feeds the sum, whose backward
    # needs nothing, and the sum is the output: so only positions <= 5 can be residuals.
    expected = {compute[j].index for j in range(0, 6, k)}
    assert saved == expected
    assert [why for _, why in others] == ["from the argument x"]


def test_every_k_counts_only_compute_ops():
    def fn(x):  # reshapes and a key-derived mask are not numbered
        x = jnp.sin(x).reshape(3, 2)
        mask = jax.random.bernoulli(jax.random.key(0), 0.5, (3, 2))
        x = jnp.sin(jnp.where(mask, x, 0.0)).reshape(6)
        return jnp.sum(jnp.sin(jnp.sin(x)))

    x = jnp.linspace(0.1, 1.0, 6)
    compute = program_of(fn, x).compute_ops
    assert [op.primitive for op in compute] == ["sin", "select_n", "sin", "sin", "sin", "reduce_sum"]
    saved, _ = saved_op_indices(jremat.checkpoint(fn, "every_k:k=2"), x)
    assert saved == {compute[0].index, compute[2].index}  # op 4's output feeds only the sum


def mlp(w1, w2, x):
    h = jnp.tanh(x @ w1)
    h = jnp.exp(h) * h
    return jnp.sum(jnp.sin(h @ w2))


def test_skip_cheap_saves_no_elementwise_output_and_keeps_matmuls():
    args = (jnp.ones((16, 32)) * 0.01, jnp.ones((32, 16)) * 0.01, jnp.ones((8, 16)))
    prog = program_of(mlp, *args)
    saved, others = saved_op_indices(jremat.checkpoint(mlp, "skip_cheap"), *args)
    assert saved, "skip_cheap saved nothing: the test would not see an elementwise output"
    assert all(prog.ops[i].is_matmul for i in saved)
    assert not any(prog.ops[i].is_elementwise for i in saved)
    assert all(why.startswith("from the argument") for _, why in others)
    # Unrestricted, the same function keeps elementwise outputs (tanh, exp): the test can fail.
    everything, _ = saved_op_indices(jremat.checkpoint(mlp, "every_k:k=1"), *args)
    assert any(prog.ops[i].is_elementwise for i in everything)


def test_skip_cheap_prices_a_loop_by_its_body():
    """A scan is no elementwise op: a scan of matmuls costs as much per byte as its matmuls, and
    skip_cheap keeps it; its elementwise consumers stay unsaved."""

    def scanned(x, ws):
        y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)
        return jnp.sum(jnp.sin(y) ** 2)

    args = (jnp.ones((64, 64)), jnp.ones((8, 64, 64)) * 0.01)
    prog = program_of(scanned, *args)
    saved, _ = saved_op_indices(jremat.checkpoint(scanned, "skip_cheap"), *args)
    assert [prog.ops[i].primitive for i in saved] == ["scan"]
    assert not prog.ops[min(saved)].is_elementwise


def named_fn(x):
    """a, b, c named; b is a reshape of an unnamed sine (its producer)."""
    a = checkpoint_name(jnp.sin(x), "q")
    b = checkpoint_name(jnp.sin(a).reshape(6, 4), "k")
    c = checkpoint_name(jnp.sin(b), "v")
    return jnp.sum(jnp.sin(c))


def test_names_saves_exactly_the_listed_names():
    x = jnp.ones((4, 6))
    residuals = saved_residuals(jremat.checkpoint(named_fn, "names:save=q+v"), x)
    assert sorted(why.split(" from ")[0] for _, why in residuals) == ["from the argument x", "named 'q'", "named 'v'"]


def test_names_except_saves_the_complement_and_not_the_unnamed_producer():
    x = jnp.ones((4, 6))
    prog = program_of(named_fn, x)
    saved, others = saved_op_indices(jremat.checkpoint(named_fn, "names_except:exclude=k"), x)
    assert sorted(prog.ops[i].tensor_name for i in saved) == ["q", "v"]
    assert [why for _, why in others] == ["from the argument x"]
    # Neither k nor sin(q) (k's unnamed producer, before the reshape) is kept in any layout.
    kept_shapes = [prog.ops[i].out_shapes[0] for i in saved]
    assert kept_shapes == [(4, 6), (6, 4)]  # q and v only
    # Excluding everything but v leaves only v (plus the input).
    saved_qk, _ = saved_op_indices(jremat.checkpoint(named_fn, "names_except:exclude=q+k"), x)
    assert [prog.ops[i].tensor_name for i in saved_qk] == ["v"]


def test_names_except_differs_from_saving_everything():
    """JAX 0.10.2's save_anything_except_these_names saves everything; ours must not."""
    x = jnp.ones((4, 6))
    ours, _ = saved_op_indices(jremat.checkpoint(named_fn, "names_except:exclude=k"), x)
    everything, _ = saved_op_indices(jremat.checkpoint(named_fn, "every_k:k=1"), x)
    assert len(everything) == 3 and len(ours) == 2


QKV_B, QKV_S, QKV_H, QKV_HD = 1, 8, 2, 4
QKV_D = QKV_H * QKV_HD


def _heads(t, name):
    return checkpoint_name(t.reshape(QKV_B, QKV_S, QKV_H, QKV_HD), name)


def fused_qkv_attention(w, x):
    """One projection split into q, k and v (``jnp.split``), then the fused attention kernel."""
    q, k, v = (_heads(t, n) for t, n in zip(jnp.split(jnp.tanh(x) @ w, 3, axis=-1), ("q", "k", "v")))
    return jnp.sum(jnp.sin(blockwise_attention(q, k, v, block_size=4)))


def separate_qkv_attention(w, x):
    """Three projections (slices of one weight), then the fused attention kernel."""
    h = jnp.tanh(x)
    q, k, v = (_heads(h @ w[:, i * QKV_D : (i + 1) * QKV_D], n) for i, n in enumerate(("q", "k", "v")))
    return jnp.sum(jnp.sin(blockwise_attention(q, k, v, block_size=4)))


QKV_ARGS = (
    jax.random.normal(jax.random.key(0), (QKV_D, 3 * QKV_D)),
    jax.random.normal(jax.random.key(1), (QKV_B, QKV_S, QKV_D)),
)


def kernel_forward_passes(fn, spec):
    layer = jremat.checkpoint(fn, spec)
    return count_forward_passes(jax.make_jaxpr(jax.value_and_grad(layer))(*QKV_ARGS))


def test_names_except_keeps_the_other_parts_of_a_split():
    """Excluding q of a fused q/k/v projection keeps k, v, the kernel's results and the projection's
    input; only q and the projection's output (which holds q) are left out."""
    prog = program_of(fused_qkv_attention, *QKV_ARGS)
    saved, _ = saved_op_indices(jremat.checkpoint(fused_qkv_attention, "names_except:exclude=q"), *QKV_ARGS)
    saved_names = {prog.ops[i].tensor_name for i in saved}
    assert {"k", "v"} <= saved_names and "q" not in saved_names
    assert not any(prog.ops[i].primitive in ("split", "dot_general") for i in saved)
    assert any(prog.ops[i].primitive == "tanh" for i in saved)  # the projection's input
    assert kernel_forward_passes(fused_qkv_attention, "names_except:exclude=q") == 1


def test_names_except_of_the_kernel_inputs_runs_the_kernel_once():
    """The kernel's loop is no elementwise copy of its inputs: excluding all of q, k and v leaves
    attn_context and attn_lse saved."""
    assert kernel_forward_passes(separate_qkv_attention, "names_except:exclude=q+k+v") == 1
    assert kernel_forward_passes(fused_qkv_attention, "names_except:exclude=q+k+v") == 1


@pytest.mark.parametrize("fn", [fused_qkv_attention, separate_qkv_attention])
@pytest.mark.parametrize("name", ["attn_context", "attn_lse"])
def test_names_except_of_a_kernel_result_runs_the_kernel_again(fn, name):
    """Excluding one of the kernel's own results does recompute it: the counts above can fail."""
    assert kernel_forward_passes(fn, f"names_except:exclude={name}") == 2


def fused_qkv_with_bias(params, x):
    """A fused q/k/v projection with a bias (matmul, bias add, split), then plain attention."""
    w, b = params
    h = jnp.tanh(x) @ w + b[None, None, :]
    q, k, v = (_heads(t, n) for t, n in zip(jnp.split(h, 3, axis=-1), ("q", "k", "v")))
    probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


def test_names_except_saves_no_fused_projection_holding_an_excluded_part():
    """Neither the split's operand nor the matmul before its bias add stands in for q (each holds
    q's data); k and v are still saved."""
    args = (QKV_ARGS[0], jnp.ones(3 * QKV_D)), QKV_ARGS[1]
    prog = program_of(fused_qkv_with_bias, *args)
    saved, _ = saved_op_indices(jremat.checkpoint(fused_qkv_with_bias, "names_except:exclude=q"), *args)
    fused_shape = (QKV_B, QKV_S, 3 * QKV_D)
    assert not [i for i in saved if fused_shape in prog.ops[i].out_shapes]
    assert {"k", "v"} <= {prog.ops[i].tensor_name for i in saved}

    # Leaving out only the split (with q's data), the bias add's output is kept to recompute q:
    # the check can fail.
    class AllButSplit(jremat.PlanPolicy):
        def plan(self, program):
            return jremat.Plan(save=frozenset(op.index for op in program.compute_ops if op.primitive != "split"))

    but_split, _ = saved_op_indices(AllButSplit().checkpoint(fused_qkv_with_bias), *args)
    assert [i for i in but_split if fused_shape in prog.ops[i].out_shapes]


def block_residuals(spec, *, dtype="float32", batch=2, seq=8, **overrides):
    cfg = preset("tiny", dtype=dtype, max_seq_len=seq, attn_dropout=0.5, resid_dropout=0.5, **overrides)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    remat = jremat.RematConfig(policy=spec, granularity="block")
    block = make_block_fn(graphdef, remat, remat.resolved_policy())
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), jnp.dtype(dtype))
    residuals = saved_residuals(lambda p, x: block(p, x, jax.random.key(0)), params, x)
    # Parameters and the 8-byte layer key are not activations.
    activations = [
        (a, why)
        for a, why in residuals
        if not why.startswith("from the argument p") and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    ]
    return cfg, activations


def test_selective_saves_no_attention_matrix():
    cfg, residuals = block_residuals("selective", batch=2, seq=8)
    square = (2, cfg.n_heads, 8, 8)
    assert not [why for aval, why in residuals if aval.shape == square]
    _, kept_by_none = block_residuals("none", batch=2, seq=8)
    assert [why for aval, why in kept_by_none if aval.shape == square], "none keeps [B,H,S,S]: the check can fail"


@pytest.mark.heavy
def test_selective_per_layer_bytes_within_megatron_bound_bf16():
    """Megatron's selective recomputation keeps 34·s·b·h bytes per layer in 16-bit, of which
    2·s·b·h are the two residual dropout masks; masks are regenerated here, so <= 32·s·b·h."""
    batch, seq = 2, 128
    _, residuals = block_residuals(
        "selective", dtype="bfloat16", batch=batch, seq=seq, d_model=768, n_heads=12, head_dim=64, d_ff=3072
    )
    h = 768
    assert residual_bytes(residuals) <= 32 * seq * batch * h
    assert not [aval for aval, _ in residuals if aval.shape == (batch, 12, seq, seq)]
    assert not [aval for aval, _ in residuals if aval.dtype == jnp.bool_]  # no dropout masks


def test_selective_rejects_half_tagged_attention():
    def fn(x):
        s = checkpoint_name(jnp.sin(x), "attn_scores")
        return jnp.sum(checkpoint_name(jnp.sin(s), "attn_context"))

    with pytest.raises(ValueError, match="tags only one side of the attention core"):
        jax.grad(jremat.checkpoint(fn, "selective"))(jnp.ones(3))


def test_selective_without_attention_says_so():
    x = jnp.linspace(0.1, 1.0, 6)
    with pytest.raises(jremat.PolicyDoesNotApply, match="no attention core.*looks for.*softmax.*Use 'full'"):
        saved_op_indices(jremat.checkpoint(sin_chain, "selective"), x)


def test_offload_moves_named_values_to_host():
    x = jnp.ones((4, 6))
    residuals = saved_residuals(jremat.checkpoint(named_fn, "offload:names=q,save=v"), x)
    host = [aval for aval, _ in residuals if "host" in str(aval)]
    assert [a.shape for a in host] == [(4, 6)]
    assert any(why.startswith("named 'v'") for _, why in residuals)
    grad = jax.grad(jremat.checkpoint(named_fn, "offload:names=q+k"))(x)
    assert float(jnp.max(jnp.abs(grad - jax.grad(named_fn)(x)))) <= 1e-6 * math.sqrt(24)
