"""jremat._measure.compile: the compiler options under which remat's savings survive XLA:CPU (compile-only)."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._measure import compile as jcompile
from tests.conftest import library_analysis_options

_ROWS, _WIDTH = 256, 512


def _bf16_layer_chain(n_layers):
    """``grad`` of a bf16 ``tanh(h @ w)`` chain scanned over layers, and its abstract arguments."""

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    ws = jax.ShapeDtypeStruct((n_layers, _WIDTH, _WIDTH), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((_ROWS, _WIDTH), jnp.bfloat16)
    return jax.grad(loss), (ws, x)


def _temp_bytes(jitted, args):
    return jremat.compiled_memory_report(jitted.lower(*args).compile()).temp_bytes


def test_options_only_on_cpu():
    assert jcompile.compiler_options("cpu") == {"xla_disable_hlo_passes": jcompile.CPU_HOISTING_PASS}
    assert jcompile.compiler_options("gpu") == {}
    assert jcompile.compiler_options("tpu") == {}


def test_jit_computes_the_same_and_user_options_win():
    f = jremat.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.linspace(0.0, 1.0, 8)
    assert jnp.array_equal(f(x), jax.jit(lambda x: jnp.sin(x) * 2)(x))
    g, args = _bf16_layer_chain(4)
    # an explicit empty pass list restores XLA's default pipeline, so the figure equals plain jit's
    overridden = jremat.jit(g, compiler_options={"xla_disable_hlo_passes": ""})
    assert _temp_bytes(overridden, args) == _temp_bytes(jax.jit(g), args)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the hoisting is an XLA:CPU behaviour")
def test_stacked_bf16_residuals_are_not_held_again_in_f32():
    (g4, a4), (g8, a8) = _bf16_layer_chain(4), _bf16_layer_chain(8)
    ours = (_temp_bytes(jremat.jit(g8), a8) - _temp_bytes(jremat.jit(g4), a4)) / 4
    plain = (_temp_bytes(jax.jit(g8), a8) - _temp_bytes(jax.jit(g4), a4)) / 4
    # per layer the backward needs the bf16 weight and the bf16 layer input
    residual_bytes_per_layer = (_WIDTH * _WIDTH + _ROWS * _WIDTH) * 2
    assert ours <= 1.1 * residual_bytes_per_layer
    # plain jit also keeps f32 copies of them (2x their bytes) hoisted out of the backward loop
    assert plain >= ours + 1.9 * residual_bytes_per_layer


def test_memory_report_compiles_like_jremat_jit_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(jcompile, "analysis_options", library_analysis_options)  # the users' options
    g, args = _bf16_layer_chain(4)
    ours = jremat.memory_report(g, *args)
    plain = jremat.memory_report(g, *args, compiler_options={})
    assert ours.temp_bytes == _temp_bytes(jremat.jit(g), args)
    assert plain.temp_bytes == _temp_bytes(jax.jit(g), args)
    if jax.default_backend() == "cpu":
        assert any("compiled as jremat.jit compiles" in n for n in ours.notes)
        assert not any("compiled as jremat.jit compiles" in n for n in plain.notes)
