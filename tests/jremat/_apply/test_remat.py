"""jremat._apply.layers and jremat._engine.tie: the remat entry points and the cotangent tie."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._engine.tie import tie_to_cotangent

BATCH, WIDTH, LAYERS = 512, 256, 8


def layer(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w)


def chain_grad(layer_fn):
    def loss(ws, x):
        for w in ws:
            x = layer_fn(w, x)
        return x.sum()

    return jax.jit(jax.grad(loss))


def chain_temp_bytes(layer_fn):
    ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    return jremat.memory_report(chain_grad(layer_fn), ws, x, compiler_options={}).temp_bytes


def test_cotangent_tie_makes_unrolled_remat_save_memory():
    no_remat = chain_temp_bytes(layer)
    tied = chain_temp_bytes(tie_to_cotangent(jax.checkpoint(layer)))
    # Measured: no remat keeps two activations per layer, the tie one (plus working buffers).
    assert tied <= 0.8 * no_remat, (tied, no_remat)


def test_cotangent_tie_keeps_gradients():
    ws = [jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) / 16 for i in range(LAYERS)]
    x = jax.random.normal(jax.random.key(99), (BATCH, WIDTH))
    expected = chain_grad(layer)(ws, x)
    got = chain_grad(tie_to_cotangent(jax.checkpoint(layer)))(ws, x)
    # Exact in real arithmetic; XLA may fuse the recomputed tanh differently (float rounding).
    for e, g in zip(expected, got):
        assert jnp.max(jnp.abs(e - g)) <= 1e-5 * jnp.max(jnp.abs(e))


def test_checkpoint_accepts_spec_and_separate_keys():
    w = jnp.eye(4)
    x = jnp.ones((2, 4))
    expected = jax.grad(lambda w: layer(w, x).sum())(w)
    for fn in (jremat.checkpoint(layer, "every_k:k=2"), jremat.checkpoint(layer, "every_k", k=2)):
        assert jnp.allclose(jax.grad(lambda w, fn=fn: fn(w, x).sum())(w), expected)


def test_remat_config_rejects_bad_granularity_and_policy():
    with pytest.raises(ValueError, match="unknown remat granularity 'layer'; valid: none, block, sublayer"):
        jremat.RematConfig(granularity="layer")
    with pytest.raises(ValueError, match="unknown policy 'bogus'; valid policies: .*every_k"):
        jremat.RematConfig(policy="bogus")


def test_remat_at_only_wraps_the_configured_level():
    config = jremat.RematConfig(policy="full", granularity="sublayer")
    assert jremat.remat_at(layer, "block", config) is layer
    assert jremat.remat_at(layer, "sublayer", config) is not layer
    with pytest.raises(ValueError, match="remat level must be 'block' or 'sublayer'"):
        jremat.remat_at(layer, "model", config)


def test_tie_rule():
    from jremat._engine.tie import needs_tie

    assert needs_tie(None) and needs_tie(1)  # straight-line code
    assert not needs_tie(2) and not needs_tie(48)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="scan_length must be None"):
            needs_tie(bad)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_layer_stacks_slices_are_attributed_to_the_models_call_of_run_layers(remat_engine, scan_layers):
    """What the stack runner binds for the model (each layer's slice of the stacked weights, the
    scan) points at the model's line in a timeline's source column, not into jremat."""
    import os
    import re

    config = jremat.RematConfig(policy="full", scan_layers=scan_layers)

    def make_layer(policy):
        return jremat.remat_at(lambda w, x, key: jnp.tanh(x @ w), "block", config, policy=policy)

    def loss(ws, x):
        return jnp.sum(jremat.run_layers(make_layer, ws, x, None, config))

    text = jax.jit(jax.grad(loss)).lower(jnp.ones((3, 4, 4)), jnp.ones((2, 4))).as_text(debug_info=True)
    paths = set(re.findall(r'loc\("([^"]+\.py)":\d+', text))
    sources = {os.path.basename(s) for s in paths}
    assert os.path.basename(__file__) in sources, sources
    assert not any(s.endswith("jremat/_apply/layers.py") for s in paths), paths
