"""``selective`` under a fused attention kernel: nothing of the attention is recomputed, and what it
says matches what happens (blockwise: the kernel is not run again; cuDNN: it is, and it says so)."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat import attention
from tests.jremat._attention.test_attention import _cudnn_like_attention

B, S, H, D = 2, 32, 2, 8


def _weights():
    return jax.random.normal(jax.random.key(0), (3, H * D, H * D)) * 0.3


def _layer(attn):
    """One untagged residual attention layer, written as a user writes it (no jremat names)."""

    def layer(w, x):
        q, k, v = (jnp.einsum("bsd,de->bse", x, w[i]).reshape(B, S, H, D) for i in range(3))
        return x + attn(q, k, v).reshape(B, S, H * D)

    return layer


def _passes(fn, w, x):
    loss = lambda w: jnp.sum(fn(w, x).astype(jnp.float32) ** 2)
    return attention.count_forward_passes(jax.make_jaxpr(jax.value_and_grad(loss))(w))


@pytest.mark.heavy
def test_selective_keeps_a_blockwise_kernel_without_tags(remat_engine):
    layer = _layer(lambda q, k, v: attention.blockwise_attention(q, k, v, block_size=8))
    w, x = _weights(), jax.random.normal(jax.random.key(1), (B, S, H * D))
    checkpointed = jremat.checkpoint(layer, "selective")
    assert _passes(checkpointed, w, x) == 1
    assert _passes(jremat.checkpoint(layer, "full"), w, x) == 2  # the count can tell
    grads = jax.grad(lambda w: jnp.sum(checkpointed(w, x) ** 2))(w)
    expected = jax.grad(lambda w: jnp.sum(layer(w, x) ** 2))(w)
    assert jnp.allclose(grads, expected, rtol=1e-5, atol=1e-6)
    explained = jremat.explain(layer, "selective", w, x, compile=False)
    assert any("fused attention kernel (blockwise)" in line and "not run again" in line for line in explained.matched)
    assert (explained.attention_forward_passes, explained.baseline_attention_forward_passes) == (1, 1)


def test_explain_says_when_a_policy_runs_the_kernel_again():
    layer = _layer(lambda q, k, v: attention.blockwise_attention(q, k, v, block_size=8))
    w, x = _weights(), jax.random.normal(jax.random.key(1), (B, S, H * D))
    explained = jremat.explain(layer, "dots", w, x, compile=False)
    assert explained.attention_forward_passes == 2
    assert any(
        m.startswith("kernel re-run (dots): kernel blockwise_attention: 2 runs, none: 1; selective keeps")
        for m in explained.messages
    )


def test_selective_on_cudnn_says_the_kernel_runs_again():
    """JAX's cuDNN forward rule names none of its statistics: selective recomputes nothing of it but
    cannot keep them, and its matched line says so instead of claiming otherwise."""
    layer = _layer(_cudnn_like_attention())
    w = _weights().astype(jnp.bfloat16)
    x = jnp.ones((B, S, H * D), jnp.bfloat16)
    explained = jremat.explain(layer, "selective", w, x, compile=False)
    assert any(
        "fused attention kernel (cuDNN)" in line and "runs the kernel again" in line for line in explained.matched
    )
    assert explained.attention_forward_passes == 2
