"""Blockwise attention: values and gradients against the explicit path, dropout masks bit for bit,
no ``[seq, seq]`` tensor, causal block skipping, and the saved residuals under both remat engines."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat import attention, names
from jremat._attention import functions as _attention_functions
from jremat._attention import inputs as _attention_inputs
from tests.conftest import saved_residuals

B, H, D = 2, 2, 8
SAVE_KERNEL_RESULTS = jax.checkpoint_policies.save_only_these_names(names.ATTN_CONTEXT, names.ATTN_LSE)


def qkv(seq, dtype=jnp.float32, batch=B, heads=H, head_dim=D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (batch, seq, heads, head_dim), jnp.float32).astype(dtype) for k in keys)


def rel_err(got, expected):
    """max |got - expected| / max |expected|, in float64 on the host."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


def value_and_grads(attn, q, k, v, key, **kwargs):
    """Output and ``(dq, dk, dv)`` of ``sum(attn(q, k, v) * w)`` for a fixed random ``w``, jitted with the key traced."""
    w = jax.random.normal(jax.random.key(9), q.shape[:3] + v.shape[3:], jnp.float32)

    def loss(q, k, v, key):
        out = attn(q, k, v, dropout_key=key, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, key)
    return out, grads


def assert_close(blockwise, reference, tol):
    (out, grads), (ref_out, ref_grads) = blockwise, reference
    errors = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errors) <= tol, errors


@pytest.mark.parametrize(
    "seq,block,causal,rate",
    [
        (48, 16, True, 0.0),
        (48, 16, True, 0.1),
        (48, 16, False, 0.0),
        (48, 16, False, 0.1),
        (50, 16, True, 0.1),  # padded to 64: three blocks and two padding keys
        (50, 16, False, 0.1),
        (7, 16, True, 0.1),  # one block, the sequence
    ],
)
def test_values_and_gradients_match_the_reference(seq, block, causal, rate):
    q, k, v = qkv(seq)
    key = jax.random.key(4)
    got = value_and_grads(
        attention.blockwise_attention, q, k, v, key, causal=causal, dropout_rate=rate, block_size=block
    )
    expected = value_and_grads(attention.reference_attention, q, k, v, key, causal=causal, dropout_rate=rate)
    assert_close(got, expected, 1e-5)


def test_bfloat16_inputs_are_close_to_the_reference():
    q, k, v = qkv(40, jnp.bfloat16)
    key = jax.random.key(4)
    out, grads = value_and_grads(attention.blockwise_attention, q, k, v, key, dropout_rate=0.1, block_size=16)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    expected = value_and_grads(attention.reference_attention, q, k, v, key, dropout_rate=0.1)
    assert_close((out, grads), expected, 2e-2)


def test_explicit_scale_and_a_value_dim_of_its_own():
    q, k, _ = qkv(20)
    v = jax.random.normal(jax.random.key(5), (B, 20, H, 3), jnp.float32)
    got, expected = jax.jit(
        lambda q, k, v: (
            attention.blockwise_attention(q, k, v, block_size=8, scale=0.3, causal=False),
            attention.reference_attention(q, k, v, scale=0.3, causal=False),
        )
    )(q, k, v)
    assert got.shape == (B, 20, H, 3)
    assert rel_err(got, expected) <= 1e-6


def test_reference_dropout_is_jremat_dropout_with_the_site_key():
    """The oracle's mask is the reference model's: ``jremat.dropout(probs, rate, layer_key, site)``."""
    layer_key, site, rate = jax.random.key(1), 3, 0.5

    @jax.jit
    def outputs(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.float32(np.sqrt(D))
        causal = jnp.tril(jnp.ones((12, 12), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
        expected = jnp.einsum("bhqk,bkhd->bqhd", jremat.dropout(probs, rate, layer_key, site), v)
        site_key = jremat.site_key(layer_key, site)
        reference = attention.reference_attention(q, k, v, dropout_rate=rate, dropout_key=site_key)
        blockwise = attention.blockwise_attention(q, k, v, block_size=4, dropout_rate=rate, dropout_key=site_key)
        unfolded = attention.reference_attention(q, k, v, dropout_rate=rate, dropout_key=layer_key)
        return expected, reference, blockwise, unfolded

    expected, reference, blockwise, unfolded = outputs(*qkv(12))
    assert rel_err(reference, expected) <= 1e-6
    assert rel_err(blockwise, expected) <= 1e-6
    assert rel_err(unfolded, expected) > 0.1  # without the site fold, another mask


@pytest.mark.parametrize(
    "shape,blocks",
    [
        ((2, 3, 37, 37), [(0, 0, 37, 37), (3, 7, 5, 11), (33, 0, 4, 9), (16, 16, 16, 16)]),
        ((1, 1, 5, 5), [(0, 0, 5, 5), (4, 1, 1, 4)]),
        ((3, 2, 64, 64), [(48, 32, 16, 16), (60, 63, 4, 1)]),
    ],
)
@pytest.mark.parametrize("wide", [False, True])
def test_dropout_blocks_are_bernoulli_over_the_full_shape_bit_for_bit(shape, blocks, wide):
    key = jax.random.fold_in(jax.random.key(3), 5)
    rate = 0.3
    full = np.asarray(jax.random.bernoulli(key, 1.0 - rate, shape))

    @jax.jit
    def drawn(key_data):  # one program for all the blocks; the block offsets are static here
        return [_attention_inputs.keep_block(key_data, rate, shape, *block, wide=wide) for block in blocks]

    for (q0, k0, rows, cols), block in zip(blocks, drawn(jax.random.key_data(key))):
        np.testing.assert_array_equal(np.asarray(block), full[:, :, q0 : q0 + rows, k0 : k0 + cols])


def test_dropout_blocks_match_under_x64():
    """With ``jax_enable_x64`` bernoulli draws float64 uniforms from 64 random bits; so do the blocks."""
    key = jax.random.key(8)
    with jax.enable_x64(True):
        full = np.asarray(jax.random.bernoulli(key, 1.0 - 0.25, (2, 3, 17, 17)))
        draw = jax.jit(lambda key_data: _attention_inputs.keep_block(key_data, 0.25, (2, 3, 17, 17), 2, 3, 6, 7))
        block = draw(jax.random.key_data(key))
        np.testing.assert_array_equal(np.asarray(block), full[:, :, 2:8, 3:10])


def test_64_bit_counts_are_exact():
    """Counts past 2**32 (batch * heads * seq * seq elements) are carried into the high word."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, 500, dtype=np.uint64)
    b = rng.integers(0, 2**32, 500, dtype=np.uint64)
    for c in (1, 2**16 + 3, 123_457, 2**32 - 1):
        high, low = _attention_inputs.mul_add_u64(jnp.asarray(a, jnp.uint32), c, jnp.asarray(b, jnp.uint32))
        got = [(int(h) << 32) | int(lo) for h, lo in zip(np.asarray(high), np.asarray(low))]
        assert got == [int(x) * c + int(y) for x, y in zip(a, b)]


def test_a_backward_pass_with_another_mask_is_caught():
    """The gradient check fails for a kernel whose backward pass draws its mask from a fresh key."""
    q, k, v = qkv(48)
    key, rate = jax.random.key(4), 0.1
    cfg = _attention_functions._Config(causal=True, block=16, seq=48, scale=1 / np.sqrt(D), dropout_rate=rate)
    out, lse = jax.jit(_attention_functions._forward, static_argnums=0)(cfg, q, k, v, jax.random.key_data(key))
    d_out = jax.random.normal(jax.random.key(9), out.shape, jnp.float32)
    reference = lambda q, k, v: attention.reference_attention(q, k, v, dropout_rate=rate, dropout_key=key)
    expected = jax.jit(lambda *args: jax.vjp(reference, *args)[1](d_out))(q, k, v)
    backward = jax.jit(_attention_functions._backward_blocks, static_argnums=0)
    for backward_key, matches in ((key, True), (jax.random.key(5), False)):
        grads = backward(cfg, q, k, v, out, lse, jax.random.key_data(backward_key), d_out)
        errors = [rel_err(g, r) for g, r in zip(grads, expected)]
        assert (max(errors) <= 1e-5) == matches, errors


def _avals(jaxpr):
    """Every value's aval in ``jaxpr`` and the jaxprs nested in its equations."""
    for var in (*jaxpr.invars, *jaxpr.outvars):
        yield var.aval
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            yield var.aval
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from _avals(getattr(item, "jaxpr", item))


def _seq_by_seq_avals(attn, seq, **kwargs):
    q, k, v = qkv(seq)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, **kwargs) ** 2)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    return [a for a in _avals(jaxpr) if sum(d >= seq for d in getattr(a, "shape", ())) >= 2]


@pytest.mark.parametrize("causal", [True, False])
def test_no_seq_by_seq_tensor_in_forward_or_backward(causal):
    kwargs = dict(causal=causal, dropout_rate=0.1, dropout_key=jax.random.key(0))
    assert _seq_by_seq_avals(attention.blockwise_attention, 50, block_size=16, **kwargs) == []
    assert _seq_by_seq_avals(attention.reference_attention, 50, **kwargs) != []  # the check finds one


def test_causal_attention_never_computes_a_block_in_a_query_blocks_future():
    """Poison the future: NaN in a key block reaches only what computes with that block.

    A masked entry still multiplies its value (``0 * NaN`` is NaN), so the explicit path, which
    masks but computes every block, spreads the NaN to every row.
    """
    q, k, v = qkv(48)
    blockwise = functools.partial(attention.blockwise_attention, block_size=16)

    @jax.jit
    def poisoned(q, k, v):
        v_last_nan = v.at[:, 32:].set(jnp.nan)  # key block 2 (keys 32..47)
        q_first_nan = q.at[:, :16].set(jnp.nan)  # query block 0, which sees key block 0 only
        results = {}
        for label, attn in (("blockwise", blockwise), ("reference", attention.reference_attention)):
            loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v) ** 2)
            _, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q_first_nan, k, v)
            results[label] = (attn(q, k, v_last_nan)[:, :32], dk[:, 16:], dv[:, 16:])
        return results

    results = poisoned(q, k, v)
    out, dk, dv = (np.asarray(x) for x in results["blockwise"])
    assert np.isfinite(out).all()  # query blocks 0 and 1 never read key block 2
    assert np.isfinite(dk).all() and np.isfinite(dv).all()  # key blocks 1 and 2 never meet query block 0
    out_ref, dk_ref, _ = (np.asarray(x) for x in results["reference"])
    assert np.isnan(out_ref).any() and np.isnan(dk_ref).any()


@pytest.mark.parametrize("dropout", [False, True])
def test_residuals_are_the_inputs_the_output_and_the_lse(remat_engine, dropout):
    q, k, v = qkv(40)
    kwargs = dict(dropout_rate=0.1, dropout_key=jax.random.key(0)) if dropout else {}
    residuals = saved_residuals(
        lambda q, k, v: attention.blockwise_attention(q, k, v, block_size=16, **kwargs), q, k, v
    )
    found = sorted((aval.str_short(), re.sub(r" from /.*", "", what)) for aval, what in residuals)
    expected = [
        ("float32[2,2,40]", "named 'attn_lse'"),
        ("float32[2,40,2,8]", "from the argument k"),
        ("float32[2,40,2,8]", "from the argument q"),
        ("float32[2,40,2,8]", "from the argument v"),
        ("float32[2,40,2,8]", "named 'attn_context'"),
    ]
    if dropout:  # the key's two words, from which the backward pass redraws the masks
        expected.append(("uint32[2]", "output of random_unwrap"))
    assert found == sorted(expected)


def _checkpointed_program(policy, rate=0.1):
    q, k, v = qkv(64)

    def loss(q, k, v):
        out = attention.blockwise_attention(q, k, v, block_size=16, dropout_rate=rate, dropout_key=jax.random.key(2))
        return jnp.sum(out**2)

    fn = loss if policy is None else jax.checkpoint(loss, policy=policy)
    return jax.value_and_grad(fn, argnums=(0, 1, 2)), (q, k, v)


def test_saving_output_and_lse_runs_the_forward_kernel_once(remat_engine):
    cp = jax.checkpoint_policies
    counts = {}
    for label, policy in [
        ("no checkpoint", None),
        ("save both", SAVE_KERNEL_RESULTS),
        ("save output only", cp.save_only_these_names(names.ATTN_CONTEXT)),
        ("save nothing", cp.nothing_saveable),
    ]:
        fn, args = _checkpointed_program(policy)
        counts[label] = (
            attention.count_forward_passes(jax.make_jaxpr(fn)(*args)),
            attention.count_forward_passes(jax.make_jaxpr(jax.jit(fn))(*args)),
        )
    assert counts == {
        "no checkpoint": (1, 1),
        "save both": (1, 1),
        "save output only": (2, 2),
        "save nothing": (2, 2),
    }


def test_the_compiled_program_runs_the_forward_loops_as_counted(remat_engine):
    """XLA's program has one forward pass (one loop over the attending block pairs) fewer when the
    kernel's results are saved: the remat3 recomputation count_forward_passes does not count is gone."""

    def loops(policy):
        fn, args = _checkpointed_program(policy, rate=0.0)
        return jax.jit(fn).lower(*args).compile().as_text().count(" while(")

    assert loops(jax.checkpoint_policies.nothing_saveable) == loops(SAVE_KERNEL_RESULTS) + 1


def test_a_kernel_in_a_scan_carry_that_a_used_output_reads_is_counted(remat_engine):
    """Carries are followed to a fixed point: the attention feeds only a carry, which the next
    iteration reads into the used output; with that output unused the kernel is dead."""
    q = jnp.ones((1, 8, 2, 4))

    def fn(total, x, use_total=True):
        def body(carry, _):
            total, x = carry
            return (total + x.sum(), attention.blockwise_attention(x, x, x, block_size=4)), None

        (total, x), _ = jax.lax.scan(body, (total, x), None, length=3)
        return total if use_total else jnp.float32(0.0)

    jaxpr = jax.make_jaxpr(fn)(0.0, q)
    assert attention.count_forward_passes(jaxpr) == 1
    assert attention.count_forward_passes(jaxpr, loop_iterations=True) == 3
    assert attention.count_forward_passes(jax.make_jaxpr(lambda t, x: fn(t, x, use_total=False))(0.0, q)) == 0


def _cudnn_like_attention():
    """A stand-in for ``jax.nn.dot_product_attention(..., implementation="cudnn")``, which traces
    only where cuDNN is found: the same structure, a custom_vjp whose forward rule binds
    ``dot_product_attention_fwd_wrapper`` (output and lse) and whose backward rule binds
    ``dot_product_attention_bwd_wrapper``."""
    fwd_p = jax.extend.core.Primitive("dot_product_attention_fwd_wrapper")
    fwd_p.multiple_results = True
    fwd_p.def_abstract_eval(
        lambda q, k, v: (q, q.update(shape=(q.shape[0], q.shape[2], q.shape[1]), dtype=jnp.float32))
    )
    bwd_p = jax.extend.core.Primitive("dot_product_attention_bwd_wrapper")
    bwd_p.multiple_results = True
    bwd_p.def_abstract_eval(lambda q, k, v, out, lse, d_out: (q, k, v))

    @jax.custom_vjp
    def attn(q, k, v):
        return fwd_p.bind(q, k, v)[0]

    def attn_fwd(q, k, v):
        out, lse = fwd_p.bind(q, k, v)
        return out, (q, k, v, out, lse)

    attn.defvjp(attn_fwd, lambda residuals, d_out: tuple(bwd_p.bind(*residuals, d_out)))
    return attn


def test_counts_cudnn_forward_kernels(remat_engine):
    attn = _cudnn_like_attention()
    q = jnp.zeros((2, 16, 2, 8), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))

    def count(fn, grad=True):
        fn = jax.value_and_grad(fn, argnums=(0, 1, 2)) if grad else fn
        return attention.count_forward_passes(jax.make_jaxpr(fn)(q, q, q))

    assert count(loss, grad=False) == 1
    assert count(loss) == 1
    assert count(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)) == 2


STACK_SEQ = 40


def _layer_stack_loss(attn, policy, weights, x):
    """Two residual attention layers in ``lax.scan``, per-layer dropout keys, each layer
    checkpointed with ``policy`` (``None``: not checkpointed)."""
    keys = jremat.layer_keys(jax.random.key(2), 2)

    def layer(x, layer_params):
        w, key = layer_params
        q, k, v = (jnp.einsum("bsd,de->bse", x, w[i]).reshape(B, STACK_SEQ, H, D) for i in range(3))
        out = attn(q, k, v, dropout_rate=0.2, dropout_key=jremat.site_key(key, 0))
        return x + out.reshape(B, STACK_SEQ, H * D), None

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    return jnp.sum(jnp.sin(jax.lax.scan(layer, x, (weights, keys))[0]))


def _layer_stack_inputs():
    weights = 0.3 * jax.random.normal(jax.random.key(1), (2, 3, H * D, H * D), jnp.float32)
    return weights, jax.random.normal(jax.random.key(0), (B, STACK_SEQ, H * D), jnp.float32)


@functools.cache
def _reference_layer_stack_grads():
    loss = functools.partial(_layer_stack_loss, attention.reference_attention, None)
    return np.asarray(jax.jit(jax.grad(loss))(*_layer_stack_inputs()))


@pytest.mark.parametrize("policy", ["save kernel results", "save nothing"])
@pytest.mark.heavy
def test_a_checkpointed_layer_stack_in_a_scan(remat_engine, policy):
    """Checkpointed layers in ``lax.scan`` have the explicit path's gradients, whether the
    backward pass reads the kernel's results or recomputes them (dropout masks included)."""
    policy = SAVE_KERNEL_RESULTS if policy == "save kernel results" else jax.checkpoint_policies.nothing_saveable
    blockwise = functools.partial(attention.blockwise_attention, block_size=16)
    loss = functools.partial(_layer_stack_loss, blockwise, policy)
    got = jax.jit(jax.grad(loss))(*_layer_stack_inputs())
    assert rel_err(got, _reference_layer_stack_grads()) <= 1e-5


def test_memory_grows_linearly_and_stays_under_the_explicit_paths():
    """Compile-only: the gradient's temporaries at 4x the sequence are at most 4.4x (the explicit
    path's grow 16x), and at most half the explicit path's."""
    batch, heads, head_dim = 8, 12, 64

    def temp_bytes(attn, seq):
        x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
        loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise = functools.partial(attention.blockwise_attention, block_size=128)
    short, long = temp_bytes(blockwise, 1024), temp_bytes(blockwise, 4096)
    assert long <= 4.4 * short
    assert long <= 0.5 * temp_bytes(attention.reference_attention, 4096)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size=-4), "block_size must be a positive int"),
        (dict(block_size=8.0), "block_size must be a positive int"),
        (dict(block_size=True), "block_size must be a positive int"),
        (dict(dropout_rate=1.0, dropout_key=jax.random.key(0)), r"dropout rate must be in \[0, 1\)"),
        (dict(dropout_rate=-0.1), r"dropout rate must be in \[0, 1\)"),
        (dict(dropout_rate=0.1, dropout_key=jax.random.key(0, impl="rbg")), "needs a threefry2x32 key.*'rbg'"),
        (dict(dropout_rate=0.1, dropout_key=jax.random.split(jax.random.key(0))), "a single key"),
        (dict(dropout_rate=0.1, dropout_key=jnp.zeros(2, jnp.float32)), "must be a PRNG key"),
        (dict(dropout_rate=0.1, dropout_key=7), "must be a PRNG key"),
        (dict(dropout_rate=0.1, dropout_key=jnp.zeros(3, jnp.uint32)), r"of shape \(2,\)"),
        (dict(dropout_rate="0.1", dropout_key=jax.random.key(0)), "dropout rate must be a number"),
        (dict(scale="2"), "scale must be a number"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match=match):
        attention.blockwise_attention(q, k, v, **kwargs)


def test_rejects_mismatched_shapes_and_dtypes():
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match="k must have q's shape"):
        attention.blockwise_attention(q, k[:, :8], v[:, :8])
    with pytest.raises(ValueError, match="v must match q"):
        attention.blockwise_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        attention.blockwise_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="q must be an array"):
        attention.blockwise_attention(q.tolist(), k, v)
    with pytest.raises(ValueError, match="must not be empty"):
        attention.blockwise_attention(q[:, :0], k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="one floating dtype"):
        attention.blockwise_attention(q, k, v.astype(jnp.bfloat16))
    for sliced in (np.s_[:0], np.s_[:, :, :0], np.s_[..., :0]):  # batch, heads, head_dim
        with pytest.raises(ValueError, match="nonzero batch, heads, head_dim"):
            attention.blockwise_attention(q[sliced], k[sliced], v[sliced])


def test_float64_inputs_are_refused_where_x64_is_on():
    q, k, v = (np.asarray(x, np.float64) for x in qkv(16))
    attend = functools.partial(attention.blockwise_attention, block_size=8)
    assert jax.eval_shape(attend, q, k, v).dtype == jnp.float32  # x64 off: canonicalized, accepted
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="float64 inputs, which would lose precision"):
            jax.eval_shape(attend, q, k, v)
        # The oracle computes in float64 (it is what higher-order derivatives are taken through).
        exact = np.asarray(attention.reference_attention(q, k, v))
        assert exact.dtype == np.float64
        w = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        w = np.where(np.tril(np.ones((16, 16), bool)), w, -np.inf)
        w = np.exp(w - w.max(-1, keepdims=True))
        expected = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)
        np.testing.assert_allclose(exact, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("argument", ["scale", "dropout_rate", "causal"])
def test_traced_static_arguments_are_refused(argument):
    q, k, v = qkv(16)
    value = {"scale": 0.5, "dropout_rate": 0.1, "causal": True}[argument]

    def attend(x):
        kwargs = {argument: x, "dropout_key": jax.random.key(0)}
        return attention.blockwise_attention(q, k, v, block_size=8, **kwargs)

    jax.eval_shape(lambda: attend(value))  # a constant is fine
    with pytest.raises(ValueError, match=f"{argument.replace('_', ' ')} must be a static"):
        jax.eval_shape(attend, value)


def test_differentiating_the_gradient_raises_instead_of_a_wrong_answer():
    """The forward loop runs on gradient-stopped inputs, so a second derivative would miss the
    saved output's and lse's dependence on q: every higher-order path raises (when traced,
    whatever the remat engine: no checkpoint is involved)."""
    q, k, v = qkv(8, batch=1, heads=1, head_dim=2)

    def loss(q):
        return jnp.sum(jnp.sin(attention.blockwise_attention(q, k, v, block_size=4)))

    def reference_loss(q):
        return jnp.sum(jnp.sin(attention.reference_attention(q, k, v)))

    first_order = jax.jit(lambda q: (jax.grad(loss)(q), jax.grad(reference_loss)(q)))(q)
    assert rel_err(*first_order) <= 1e-5
    second_orders = {
        "hessian": lambda: jax.hessian(loss),
        "grad of grad": lambda: jax.grad(lambda x: jnp.sum(jax.grad(loss)(x))),
        "jvp of grad": lambda: lambda x: jax.jvp(jax.grad(loss), (x,), (jnp.ones_like(x),)),
    }
    for make in second_orders.values():
        with pytest.raises(NotImplementedError, match="first-order reverse-mode derivatives only"):
            jax.eval_shape(make(), q)
    jax.eval_shape(jax.hessian(reference_loss), q)  # the oracle has one: the refusal is blockwise's own


def test_vmap_batches_the_kernel_and_its_name_tags(remat_engine):
    q, k, v = (jnp.stack([x, x * 0.5]) for x in qkv(16))
    attend = functools.partial(attention.blockwise_attention, block_size=8)

    def loss(attn, q, k, v):
        return jnp.sum(jnp.sin(attn(q, k, v)))

    @jax.jit
    def outputs_and_grads(q, k, v):
        per_example = lambda attn: (jax.vmap(attn)(q, k, v), jax.vmap(jax.grad(functools.partial(loss, attn)))(q, k, v))
        return per_example(attend), per_example(attention.reference_attention)

    (outs, grads), (ref_outs, ref_grads) = outputs_and_grads(q, k, v)
    assert rel_err(outs, ref_outs) <= 1e-5
    assert rel_err(grads, ref_grads) <= 1e-5


def test_rejects_dropout_without_partitionable_threefry():
    q, k, v = qkv(16)
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        with pytest.raises(ValueError, match="needs jax_threefry_partitionable=True"):
            attention.blockwise_attention(q, k, v, dropout_rate=0.1, dropout_key=jax.random.key(0))
    finally:
        jax.config.update("jax_threefry_partitionable", before)


def test_a_legacy_uint32_key_is_the_typed_key():
    attn = jax.jit(functools.partial(attention.blockwise_attention, block_size=8, dropout_rate=0.3))
    q, k, v = qkv(24)
    typed = attn(q, k, v, dropout_key=jax.random.key(6))
    raw = attn(q, k, v, dropout_key=jax.random.PRNGKey(6))
    np.testing.assert_array_equal(np.asarray(typed), np.asarray(raw))


def test_flop_counts_see_every_attending_block_pair():
    """The kernel loops over a static list of block pairs (a scan of known length), so
    jremat.program_flops counts every pair: causal costs about half of non-causal, and 4x the
    sequence costs about 16x the attention FLOPs."""
    import jremat

    def flops(seq, causal):
        q = jax.ShapeDtypeStruct((1, seq, 1, 8), jnp.float32)
        loss = lambda q, k, v: jnp.sum(attention.blockwise_attention(q, k, v, causal=causal, block_size=8))
        return jremat.program_flops(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, q, q)

    assert 0.5 < flops(64, True) / flops(64, False) < 0.7  # 36 of 64 block pairs, plus the masking
    assert 15 < flops(256, False) / flops(64, False) <= 16.5
