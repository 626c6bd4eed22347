"""``jremat.Policy``: the untied checkpoint a subclass defines, under its name and its older one."""

import jax
import jax.numpy as jnp

import jremat
from jremat._apply.policy import CallbackPolicy, PlanPolicy


class SavesNothing(PlanPolicy):
    def plan(self, program):
        return jremat.Plan()


class CountsUnderTheOlderName(SavesNothing):
    """A subclass written against ``checkpoint``, calling its parent by that name."""

    calls = 0

    def checkpoint(self, fn, *, prevent_cse=True):
        CountsUnderTheOlderName.calls += 1
        return super().checkpoint(fn, prevent_cse=prevent_cse)


class CountsUnderTheNewName(CountsUnderTheOlderName):
    """Its subclass written against ``checkpoint_untied``, calling its parent by that name."""

    new_calls = 0

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        CountsUnderTheNewName.new_calls += 1
        return super().checkpoint_untied(fn, prevent_cse=prevent_cse)


def f(x):
    return jnp.sum(jnp.sin(jnp.sin(x)))


def test_both_names_reach_a_subclass_definition_and_wrap_uses_it():
    CountsUnderTheOlderName.calls = CountsUnderTheNewName.new_calls = 0
    x = jnp.ones(3)
    older = CountsUnderTheOlderName()
    for apply in (older.wrap, older.checkpoint, older.checkpoint_untied):
        assert float(jnp.max(jnp.abs(jax.grad(apply(f))(x) - jax.grad(f)(x)))) < 1e-6
    assert CountsUnderTheOlderName.calls == 3
    newer = CountsUnderTheNewName()
    for apply in (newer.wrap, newer.checkpoint, newer.checkpoint_untied):
        apply(f)
    assert CountsUnderTheNewName.new_calls == 3
    assert CountsUnderTheOlderName.calls == 6  # each reached the older-name parent once


def test_the_older_name_is_the_untied_checkpoint():
    policy = CallbackPolicy(jax.checkpoint_policies.nothing_saveable)
    x = jnp.ones(3)
    untied, older = policy.checkpoint_untied(f), policy.checkpoint(f)
    assert str(jax.make_jaxpr(jax.grad(untied))(x)) == str(jax.make_jaxpr(jax.grad(older))(x))
    assert str(jax.make_jaxpr(jax.grad(policy.wrap(f)))(x)) != str(jax.make_jaxpr(jax.grad(untied))(x))
