"""jremat.memory: compiled memory report, saved-residual breakdown, FLOPs, live stats (compile-only, tiny)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jremat
from jremat import memory as jmem
from models import preset
from models.gpt import Block, make_block_fn


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


def test_memory_report_fields_positive_and_consistent():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    report = jremat.memory_report(jax.grad(f), w, x)
    assert report.available
    assert report.argument_bytes == (64 * 64 + 32 * 64) * 4
    assert report.output_bytes == 64 * 64 * 4
    assert report.temp_bytes > 0
    assert report.peak_bytes >= report.temp_bytes
    assert report.peak_bytes >= report.summed_peak_bytes - report.temp_bytes
    if report.peak_source == jmem.PEAK_FROM_SUM:
        assert report.peak_bytes == report.summed_peak_bytes


class _FakeStats:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeCompiled:
    def __init__(self, stats):
        self.stats = stats

    def memory_analysis(self):
        return self.stats


def test_unavailable_memory_analysis_is_reported_not_zero():
    none = jmem.compiled_memory_report(_FakeCompiled(None), platform="tpu")
    assert not none.available and none.peak_bytes is None and "18954" in none.notes[0]
    zeros = _FakeStats(argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
                       temp_size_in_bytes=0, generated_code_size_in_bytes=0)
    report = jmem.compiled_memory_report(_FakeCompiled(zeros), platform="gpu")
    assert not report.available and report.temp_bytes is None and "zero" in report.notes[0]


def test_peak_source_backend_vs_sum():
    stats = dict(argument_size_in_bytes=100, output_size_in_bytes=50, alias_size_in_bytes=10,
                 temp_size_in_bytes=1000, generated_code_size_in_bytes=0)
    full_peak = jmem.compiled_memory_report(_FakeCompiled(_FakeStats(peak_memory_in_bytes=1200, **stats)), platform="gpu")
    assert full_peak.peak_source == jmem.PEAK_FROM_BACKEND and full_peak.peak_bytes == 1200
    cpu_like = jmem.compiled_memory_report(_FakeCompiled(_FakeStats(peak_memory_in_bytes=150, **stats)), platform="cpu")
    assert cpu_like.peak_source == jmem.PEAK_FROM_SUM and cpu_like.peak_bytes == 100 + 50 - 10 + 1000
    assert "leaves temp buffers out" in cpu_like.notes[0]
    # XLA:CPU's argument + output can exceed a small temp; it still leaves temp out.
    small_temp = dict(stats, temp_size_in_bytes=40)
    cpu_big = jmem.compiled_memory_report(_FakeCompiled(_FakeStats(peak_memory_in_bytes=150, **small_temp)), platform="cpu")
    assert cpu_big.peak_source == jmem.PEAK_FROM_SUM and cpu_big.peak_bytes == 100 + 50 - 10 + 40


def test_full_saves_exactly_one_block_input(bf16_tiny):
    fn, args = _block(bf16_tiny, "full")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    b, s, d = args[1].shape
    assert report.saved_bytes == b * s * d * 2
    assert report.saved_bytes_per_layer == b * s * d * 2
    [act] = [r for r in report.residuals if r.kind == jmem.ACTIVATION]
    assert act.name == "block_input" and act.shape == (b, s, d)
    assert report.bytes_of(jmem.RNG_KEY) == 8
    assert report.bytes_of(jmem.PARAMETER) > 0


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
    masks = [r for r in report.residuals if r.kind == jmem.ACTIVATION and r.dtype == "bool"]
    assert len(masks) == 3  # two residual-dropout masks and one attention-dropout mask
    assert all(r.source for r in report.residuals)


def test_selective_keeps_no_attention_matrix(bf16_tiny):
    if "selective" not in jremat.available():
        pytest.skip("policy 'selective' is not registered in this checkout")
    fn, args = _block(bf16_tiny, "selective")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    b, s, _ = args[1].shape
    square = [r for r in report.residuals if r.kind == jmem.ACTIVATION and r.shape[-2:] == (s, s)]
    assert square == [], square
    none_fn, none_args = _block(bf16_tiny, "none")
    assert report.saved_bytes < jremat.saved_residuals_report(none_fn, *none_args, param_argnums=(0,)).saved_bytes


def test_plan_policy_tags_map_back_to_names(bf16_tiny):
    fn, args = _block(bf16_tiny, "every_k:k=4")
    report = jremat.saved_residuals_report(fn, *args, param_argnums=(0,))
    tagged = [r for r in report.residuals if r.plan_tag is not None]
    assert tagged, "every_k should save tagged values"
    assert all(r.plan_tag.startswith("jremat") for r in tagged)
    assert all(not r.label.startswith("jremat") for r in report.residuals)


def test_scan_stacked_residuals_match_block_times_layers(bf16_tiny):
    from models import GPT, cross_entropy_loss

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


def test_program_flops_counts_scan_iterations_and_recompute():
    w = jax.ShapeDtypeStruct((8, 16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)

    def body(h, wi):
        return jnp.tanh(h @ wi), None

    def fwd(ws, h):
        return jnp.sum(jax.lax.scan(body, h, ws)[0])

    # 8 iterations x (2*4*16*16 matmul + 64 tanh) + the final sum of 64 elements.
    assert jremat.program_flops(fwd, w, x) == 8 * (2 * 4 * 16 * 16 + 64) + 64

    def fwd_remat(ws, h):
        return jnp.sum(jax.lax.scan(jax.checkpoint(body), h, ws)[0])

    extra = jremat.program_flops(jax.grad(fwd_remat), w, x) - jremat.program_flops(jax.grad(fwd), w, x)
    assert extra >= 8 * (2 * 4 * 16 * 16)


def test_live_memory_on_cpu_says_not_available():
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports allocator statistics; the CPU path is not exercised")
    ran = []
    result = jremat.live_memory(lambda: ran.append(1))
    assert not result.available and result.peak_bytes_in_use is None
    assert "memory_stats() is None" in result.reason and ran == []


def test_diagnose_remat_flags_temp_that_did_not_follow():
    note = jremat.diagnose_remat(100, 100, 10.0, 1000.0, scan_layers=False)
    assert note is not None and "concurrency" in note and "fell" in note
    assert jremat.diagnose_remat(50, 100, 10.0, 100.0, scan_layers=True) is None
    assert jremat.diagnose_remat(100, 100, 95.0, 100.0) is None  # residuals barely changed
