"""jremat._explain.residuals: the saved-residual breakdown of a block and of a scanned stack (traced, tiny)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jremat
from jremat import attention
from jremat._explain import residuals as jres
from jremat.models import preset
from jremat.models.gpt import Block, make_block_fn
from tests.conftest import run_under_engine


def _block(cfg, policy, granularity="block", batch=2):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    rc = jremat.RematConfig(policy=policy, granularity=granularity, scan_layers=True)
    fn = make_block_fn(graphdef, rc, rc.resolved_policy())
    x = jax.ShapeDtypeStruct((batch, cfg.max_seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return fn, (params, x, key)


@pytest.fixture
def bf16_tiny():
    return preset("tiny", dtype="bfloat16")


def test_full_saves_exactly_one_block_input(bf16_tiny):
    fn, args = _block(bf16_tiny, "full")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    b, s, d = args[1].shape
    assert report.saved_bytes == b * s * d * 2
    assert report.saved_bytes_per_layer == b * s * d * 2
    [act] = [r for r in report.residuals if r.kind == jres.ACTIVATION]
    assert act.name == "block_input" and act.shape == (b, s, d)
    assert report.bytes_of(jres.RNG_KEY) == 8
    assert report.bytes_of(jres.PARAMETER) > 0


def test_none_matches_megatron_accounting(bf16_tiny):
    # d_ff = 4 d_model, as in Megatron's formula; heads * head_dim = d_model.
    cfg = bf16_tiny.replace(d_ff=4 * bf16_tiny.d_model)
    fn, args = _block(cfg, "none")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    b, s, h = args[1].shape
    a = cfg.n_heads
    assert report.saved_bytes == s * b * h * (34 + 5 * a * s / h)
    labels = {g.label for g in report.groups()}
    assert {"block_input", "q", "k", "v", "attn_scores", "attn_probs", "mlp_in", "mlp_act"} <= labels
    masks = [r for r in report.residuals if r.kind == jres.ACTIVATION and r.dtype == "bool"]
    assert len(masks) == 3  # two residual-dropout masks and one attention-dropout mask
    assert all(r.source for r in report.residuals)


def test_selective_keeps_no_attention_matrix(bf16_tiny):
    if "selective" not in jremat.available():
        pytest.skip("policy 'selective' is not registered in this checkout")
    fn, args = _block(bf16_tiny, "selective")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    b, s, _ = args[1].shape
    square = [r for r in report.residuals if r.kind == jres.ACTIVATION and r.shape[-2:] == (s, s)]
    assert square == [], square
    none_fn, none_args = _block(bf16_tiny, "none")
    assert report.saved_bytes < jremat.saved_residuals_report(none_fn, *none_args, param_argnums=(0,)).saved_bytes


def test_plan_policy_tags_map_back_to_names(bf16_tiny):
    fn, args = _block(bf16_tiny, "every_k:k=4")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    tagged = [r for r in report.residuals if r.internal_tag is not None]
    assert tagged, "every_k should save tagged values"
    assert all(r.internal_tag.startswith("jremat") for r in tagged)
    assert [r.plan_tag for r in report.residuals] == [r.internal_tag for r in report.residuals]
    assert all(not r.label.startswith("jremat") for r in report.residuals)


def test_scan_stacked_residuals_match_block_times_layers(bf16_tiny):
    from jremat.models import GPT, cross_entropy_loss

    cfg = bf16_tiny.replace(remat_policy="full", n_layers=3)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((2, cfg.max_seq_len), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))

    def loss(p, tok, k):
        return cross_entropy_loss(nnx.merge(graphdef, p), tok, tok, k)

    whole = jremat.saved_residuals_report(loss, params, tokens, key, n_layers=3, param_argnums=(0,))
    fn, args = _block(cfg, "full")
    block = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    assert whole.layer_stacked_bytes == 3 * block.saved_bytes
    stacked = [r for r in whole.residuals if r.layer_stacked]
    assert stacked and all(r.shape[0] == 3 for r in stacked)


def test_param_argnums_validated(bf16_tiny):
    fn, args = _block(bf16_tiny, "full")
    with pytest.raises(ValueError, match="names no argument"):
        jremat.saved_residuals_report(fn, *args, param_argnums=(5,))
    with pytest.raises(ValueError, match="n_layers"):
        jremat.saved_residuals_report(fn, *args, n_layers=0)


def _blockwise_layer_stack(policy):
    """A scanned stack of layers calling blockwise attention under ``jremat.checkpoint``."""
    batch, seq, heads, head_dim = 2, 16, 2, 8
    width = heads * head_dim

    def layer(x, w, key):
        q, k, v = (jnp.reshape(x @ (w * s), (batch, seq, heads, head_dim)) for s in (1.0, 0.5, 0.25))
        out = attention.blockwise_attention(q, k, v, block_size=8, dropout_rate=0.1, dropout_key=key)
        return jnp.tanh(out.reshape(batch, seq, width) @ w)

    def loss(x, ws, keys):
        def body(x, wk):
            return jremat.checkpoint(layer, policy=policy)(x, *wk), None

        return jnp.sum(jax.lax.scan(body, x, (ws, keys))[0])

    args = (jnp.ones((batch, seq, width)), jnp.full((3, width, width), 0.1), jax.random.split(jax.random.key(0), 3))
    return loss, args


@pytest.mark.parametrize(
    "policy, int_output",
    [("selective", False), ("selective", True), ("names:save=attn_context+attn_lse", False)],
)
def test_residuals_only_a_dead_recomputation_reads_are_not_counted(policy, int_output):
    """Under remat3 a saved value's recomputation stays in the backward program, dead; the
    residuals only it reads (here the kernel's blocked output and lse) are not kept by XLA, and
    the report counts what the classic engine's does (also beside an integer output)."""
    loss, args = _blockwise_layer_stack(policy)
    fn = (lambda *a: (loss(*a), jnp.argmax(a[0]))) if int_output else loss
    computed = {}
    for engine in ("classic", "remat3"):
        with run_under_engine(engine):
            computed[engine] = jremat.saved_residuals_report(fn, *args, param_argnums=(1,)).computed_bytes
    assert computed["remat3"] == computed["classic"], computed
