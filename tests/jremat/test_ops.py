"""jremat.ops: the transformer ops whose backward pass keeps only their inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jremat import ops
from tests.conftest import saved_residuals


def _gate_and_up():
    gate = jax.random.normal(jax.random.key(0), (4, 8), jnp.float32)
    up = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)
    return gate, up


def test_swiglu_is_silu_of_the_gate_times_up_with_plain_autodiff_gradients():
    gate, up = _gate_and_up()
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    np.testing.assert_allclose(np.asarray(ops.swiglu(gate, up)), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    plain = lambda g, u: jnp.sum(jnp.sin(jax.nn.silu(g) * u))
    ours = lambda g, u: jnp.sum(jnp.sin(ops.swiglu(g, u)))
    for want, got in zip(jax.grad(plain, (0, 1))(gate, up), jax.grad(ours, (0, 1))(gate, up)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_swiglu_keeps_only_its_inputs_where_plain_autodiff_keeps_the_sigmoid_too():
    gate, up = _gate_and_up()
    ours = [str(note) for _, note in saved_residuals(lambda g, u: jnp.sum(ops.swiglu(g, u)), gate, up)]
    plain = saved_residuals(lambda g, u: jnp.sum(jax.nn.silu(g) * u), gate, up)
    assert len(ours) == 2 and all("argument" in note for note in ours), ours
    assert len(plain) > 2  # the sigmoid (and silu) outputs: what the op's checkpoint drops
