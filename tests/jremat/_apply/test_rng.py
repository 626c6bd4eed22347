"""Key threading: masks are pure functions of (key, layer, site)."""

import jax
import jax.numpy as jnp
import pytest

import jremat


def test_layer_keys_are_fold_in_of_layer_index():
    key = jax.random.key(3)
    keys = jremat.layer_keys(key, 4)
    assert keys.shape == (4,)
    for i in range(4):
        assert jnp.array_equal(jax.random.key_data(keys[i]), jax.random.key_data(jax.random.fold_in(key, i)))


def test_dropout_is_deterministic_per_key_and_site():
    x = jnp.ones((64, 64))
    key = jax.random.key(0)
    a = jremat.dropout(x, 0.5, key, site_id=1)
    assert jnp.array_equal(a, jremat.dropout(x, 0.5, key, site_id=1))
    assert not jnp.array_equal(a, jremat.dropout(x, 0.5, key, site_id=2))
    assert set(jnp.unique(a).tolist()) == {0.0, 2.0}
    assert 0.4 < float(jnp.mean(a == 0.0)) < 0.6


def test_dropout_without_key_is_identity():
    x = jnp.arange(6.0)
    assert jremat.dropout(x, 0.5, None, 0) is x
    assert jremat.layer_keys(None, 3) is None


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_rejects_bad_rate(rate):
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\)"):
        jremat.dropout(jnp.ones(3), rate, jax.random.key(0), 0)


def test_layer_keys_rejects_non_positive_count():
    with pytest.raises(ValueError, match="n_layers must be positive"):
        jremat.layer_keys(jax.random.key(0), 0)
