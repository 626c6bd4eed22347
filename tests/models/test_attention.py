"""ModelConfig.attention: blockwise, xla and pallas attention give explicit's gradients under policies,
fused forward passes per policy, config-time errors, and blockwise memory linear in the sequence."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat.attention import pallas_attention, pallas_block_sizes, reference_attention
from jremat.models import preset
from jremat.models.config import check_attention_backend
from jremat.train.programs import attention_forward_passes, step_program
from tests.conftest import loss_and_grads, max_relative_error
from tests.policies.test_policy_gradients import EXAMPLE_SPECS

TOLERANCE = 1e-5

#: One spec per built-in policy; names_except excludes a name blockwise attention also tags
#: (it has no attn_probs).
SPECS = {**EXAMPLE_SPECS, "names_except": "names_except:exclude=q+mlp_act"}


def _cfg(attention, policy, dropout):
    return preset(
        "tiny",
        attention=attention,
        attention_block_size=8,
        remat_policy=policy,
        attn_dropout=dropout,
        resid_dropout=dropout,
    )


@functools.cache
def _explicit_reference(dropout: float):
    return loss_and_grads(_cfg("explicit", "none", dropout).replace(remat_granularity="none"))


def test_every_built_in_policy_is_covered():
    assert set(SPECS) == set(jremat.available()) - {"test_fresh_key_on_recompute"}


#: Without dropout, the kernel under the policies that treat it differently: saved whole (none),
#: run again (full), kept by its structure (selective) or by its tensor names (names); every
#: policy runs with dropout, the kernel's other path, and all of them without it under ``-m slow``.
_NO_DROPOUT_IN_CI = {"none", "full", "selective", "names"}


@pytest.mark.parametrize(
    "dropout, name",
    [pytest.param(0.1, name, id=f"dropout-{name}") for name in SPECS]
    + [
        pytest.param(0.0, name, id=f"no-dropout-{name}", marks=() if name in _NO_DROPOUT_IN_CI else pytest.mark.slow)
        for name in SPECS
    ],
)
@pytest.mark.heavy
def test_blockwise_gives_explicit_gradients_under_every_policy(dropout, name):
    """Same dropout masks (regenerated from the layer key, never stored), float32."""
    ref_loss, ref_grads = _explicit_reference(dropout)
    loss, grads = loss_and_grads(_cfg("blockwise", SPECS[name], dropout))
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.mark.heavy
def test_blockwise_with_a_fresh_dropout_key_differs():
    """The comparison above has teeth: another dropout key gives other gradients."""
    _, ref_grads = _explicit_reference(0.1)
    _, grads = loss_and_grads(_cfg("blockwise", "full", 0.1), seed=7)
    assert max_relative_error(grads, ref_grads) > 100 * TOLERANCE


def test_xla_attention_gives_explicit_gradients():
    ref_loss, ref_grads = _explicit_reference(0.0)
    loss, grads = loss_and_grads(_cfg("xla", "selective", 0.0))
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.mark.parametrize(
    "spec, scan_layers",
    [("none", True), ("full", True), ("full", False), ("dots", False)],
    ids=["none-scan", "full-scan", "full-unrolled", "dots-unrolled"],
)
@pytest.mark.heavy
def test_pallas_gives_explicit_gradients(spec, scan_layers):
    """JAX's Pallas flash attention (interpreted on a CPU), no dropout: explicit's loss and gradients."""
    ref_loss, ref_grads = _explicit_reference(0.0)
    loss, grads = loss_and_grads(_cfg("pallas", spec, 0.0).replace(scan_layers=scan_layers))
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.mark.heavy
def test_pallas_attention_matches_the_reference_and_a_wrong_mask_is_caught():
    """The kernel's gradients equal reference_attention's; the same kernel without the causal mask
    (a deliberately broken variant) is far off, so the comparison has teeth."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 2, 16)) for i in range(3))
    weights = jax.random.normal(jax.random.key(3), q.shape)

    def grads(attend):
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * weights), argnums=(0, 1, 2))(q, k, v)

    reference = grads(lambda q, k, v: reference_attention(q, k, v, causal=True))
    assert max_relative_error(grads(lambda q, k, v: pallas_attention(q, k, v, block_size=8)), reference) <= TOLERANCE
    unmasked = grads(lambda q, k, v: pallas_attention(q, k, v, causal=False, block_size=8))
    assert max_relative_error(unmasked, reference) > 100 * TOLERANCE


@pytest.mark.parametrize(
    "block_size, seq, message",
    [
        (128, 12, r"min\(128, 12\) = 12 must be a power of two"),
        (8, 20, r"must be a power of two \(Triton tiles\) that divides the sequence \(20\)"),
        (0, 16, "block_size must be a positive int, got 0"),
    ],
)
def test_pallas_block_sizes_refuse_what_the_kernel_cannot_tile(block_size, seq, message):
    with pytest.raises(ValueError, match=message):
        pallas_block_sizes(block_size, seq)


@pytest.mark.parametrize("block_size, seq, forward, backward", [(128, 16, 16, 16), (128, 1024, 128, 32), (8, 16, 8, 8)])
def test_pallas_block_sizes_suit_tiny_and_gpu_shapes(block_size, seq, forward, backward):
    sizes = pallas_block_sizes(block_size, seq)
    assert (sizes.block_q, sizes.block_k) == (forward, forward)
    assert {sizes.block_q_dkv, sizes.block_kv_dkv, sizes.block_q_dq, sizes.block_kv_dq} == {backward}


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
@pytest.mark.heavy
def test_selective_runs_the_pallas_kernel_once_per_layer(remat_engine, scan_layers):
    """selective keeps the output and log-sum-exp the Pallas kernel's forward rule hands its backward
    rule: one mha_forward per layer, as none; full runs it twice (the count sees a re-run)."""
    cfg = lambda spec: _cfg("pallas", spec, 0.0).replace(scan_layers=scan_layers)
    assert [attention_forward_passes(cfg(spec), 2) for spec in ("none", "selective", "full")] == [1, 1, 2]


@pytest.mark.heavy
def test_selective_gives_none_gradients_under_pallas(remat_engine):
    ref_loss, ref_grads = loss_and_grads(_cfg("pallas", "none", 0.0))
    loss, grads = loss_and_grads(_cfg("pallas", "selective", 0.0))
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


def test_selective_without_the_kernel_split_runs_the_pallas_kernel_again(remat_engine, monkeypatch):
    """The split of the kernel's custom_vjp is what keeps the log-sum-exp: without it, selective
    runs the forward kernel again in the backward pass."""
    monkeypatch.setattr(jremat.kernels, "split_kernels", lambda fn, which=None: fn)
    assert attention_forward_passes(_cfg("pallas", "selective", 0.0), 2) == 2


@pytest.mark.heavy
def test_selective_compiled_temp_is_at_most_none_under_pallas(remat_engine):
    none, selective = (_temp_bytes(_cfg("pallas", spec, 0.0), 2, 16) for spec in ("none", "selective"))
    assert selective <= none, (selective, none)


@pytest.mark.parametrize(
    "spec, passes",
    [
        ("none", 1),
        ("selective", 1),
        ("names:save=attn_context+attn_lse", 1),
        ("offload:names=attn_context+attn_lse", 1),
        ("full", 2),
        ("dots", 2),
        ("names:save=q+k+v", 2),
        ("nested:block=2", 2),
    ],
)
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
@pytest.mark.heavy
def test_fused_forward_passes_per_layer(spec, passes, scan_layers):
    """1: the backward pass reads the kernel's saved output and log-sum-exp; 2: it runs the kernel again."""
    cfg = _cfg("blockwise", spec, 0.1).replace(scan_layers=scan_layers)
    assert attention_forward_passes(cfg, 2) == passes


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_fused_forward_passes_average_over_layer_groups(scan_layers):
    """One layer of two recomputes the kernel, the other keeps its results: 1.5 per layer."""
    cfg = _cfg("blockwise", "none", 0.1).replace(scan_layers=scan_layers, remat_layer_policies="1:full,rest:none")
    assert attention_forward_passes(cfg, 2) == 1.5


def test_explicit_and_xla_have_no_fused_kernel():
    assert attention_forward_passes(_cfg("explicit", "full", 0.1), 2) == 0
    assert attention_forward_passes(_cfg("xla", "full", 0.0), 2) == 0


def _temp_bytes(cfg, batch, seq):
    grad_fn, args = step_program(cfg, batch, seq)
    return jremat.memory_report(grad_fn, *args).temp_bytes


@pytest.mark.heavy
def test_blockwise_memory_grows_linearly_in_the_sequence():
    """Compile-only: 4x the sequence, at most 4.4x the temp memory under blockwise; explicit grows
    faster (its [seq, seq] scores), and at the long sequence blockwise needs at most half."""
    cfg = preset(
        "tiny",
        n_layers=1,
        n_heads=4,
        vocab_size=16,
        max_seq_len=512,
        attention_block_size=32,
        remat_policy="none",
        remat_granularity="none",
        attn_dropout=0.0,
        resid_dropout=0.0,
    )
    blockwise = [_temp_bytes(cfg.replace(attention="blockwise"), 2, s) for s in (128, 512)]
    explicit = [_temp_bytes(cfg, 2, s) for s in (128, 512)]
    assert blockwise[1] <= 4.4 * blockwise[0], blockwise
    assert explicit[1] > 4.4 * explicit[0], explicit
    assert blockwise[1] <= 0.5 * explicit[1], (blockwise, explicit)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention="flash"), "attention must be one of explicit, xla, cudnn, blockwise"),
        (dict(attention="blockwise", attention_block_size=0), "attention_block_size must be a positive integer"),
        (dict(attention="xla"), "has no attention dropout, but attn_dropout is 0.1"),
        (
            dict(attention="pallas"),
            r"attention 'pallas' \(JAX's Pallas flash attention\) has no attention dropout, but attn_dropout is 0.1; "
            r"set it to 0 \(--dropout 0\) or use attention 'blockwise'",
        ),
        (dict(attention="cudnn", attn_dropout=0.0, resid_dropout=0.0), "needs dtype bfloat16"),
        (
            dict(attention="cudnn", attn_dropout=0.0, dtype="bfloat16", head_dim=12),
            "head_dim a multiple of 8 and at most 128",
        ),
    ],
)
def test_attention_config_errors_name_what_is_valid(changes, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **changes)


class _FakeDevice:
    def __init__(self, platform, kind, compute_capability="0", platform_version=""):
        self.platform, self.device_kind, self.compute_capability = platform, kind, compute_capability
        self.client = type("Client", (), {"platform_version": platform_version})()


@pytest.mark.parametrize(
    "device, head_dim, message",
    [
        (_FakeDevice("cpu", "cpu"), 64, "needs an NVIDIA GPU with cuDNN, but JAX runs on cpu"),
        (_FakeDevice("tpu", "TPU v5 lite"), 64, "needs an NVIDIA GPU with cuDNN, but JAX runs on tpu"),
        (_FakeDevice("gpu", "AMD Instinct MI300X", platform_version="rocm 6.2"), 64, "needs an NVIDIA GPU"),
        (_FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0", "cuda 12080"), 256, "takes head_dim up to 128, got 256"),
        (_FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0", "cuda 12080"), 256, None),
        (_FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0", "cuda 12080"), 128, None),
    ],
)
def test_cudnn_needs_an_nvidia_gpu_of_the_right_generation(device, head_dim, message):
    if message is None:
        check_attention_backend("cudnn", head_dim, devices=[device])
    else:
        with pytest.raises(ValueError, match=message):
            check_attention_backend("cudnn", head_dim, devices=[device])


def test_on_this_machine_cudnn_is_refused_and_blockwise_is_not():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU with cuDNN, but JAX runs on cpu"):
        check_attention_backend("cudnn", 64)
    cpu = _FakeDevice("cpu", "cpu")
    for attention in ("explicit", "xla", "blockwise", "pallas"):
        check_attention_backend(attention, 64, devices=[cpu])
