"""``auto`` on one checkpointed function: the budget is kept, and a larger one keeps more."""

import jax.numpy as jnp

import jremat
from tests.conftest import saved_residuals


def mlp(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sin(h @ w2) @ w2.T


def saved_bytes(policy_spec):
    w1, w2, x = jnp.ones((32, 64)), jnp.ones((64, 64)), jnp.ones((16, 32))
    fn = jremat.checkpoint(mlp, policy_spec)
    residuals = saved_residuals(lambda w1, w2, x: fn(w1, w2, x).sum(), w1, w2, x)
    return sum(a.size * a.dtype.itemsize for a, where in residuals if "argument" not in where)


def test_function_level_auto_respects_budget_and_is_monotonic():
    budgets = [0, 4096, 8192, 16384, 65536]
    used = [saved_bytes(f"auto:budget={b}") if b else saved_bytes("full") for b in budgets]
    for budget, u in zip(budgets[1:], used[1:]):
        assert u <= budget
    assert used == sorted(used)
    assert used[-1] > used[0]


def test_auto_spec_round_trips():
    assert jremat.resolve("auto:budget=64KiB").spec == "auto:budget=64KiB"
