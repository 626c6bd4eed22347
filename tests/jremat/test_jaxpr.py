"""Liveness through calls and scans: which inputs a jaxpr's used outputs read."""

import jax
import jax.numpy as jnp

from jremat import _jaxpr


@jax.custom_jvp
def first_of(value, ignored):
    """Returns ``value``; ``ignored`` only feeds the JVP (the shape of remat3's saved-value call)."""
    return value


first_of.defjvp(lambda primals, tangents: (primals[0], tangents[1]))


def test_an_input_only_an_ignoring_call_reads_is_dead():
    def fn(a, b):
        return first_of(a * 2.0, jnp.sin(b))

    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(1.0, 2.0)) == [True, False]


def test_a_scan_reads_what_its_body_reads_and_carries_reach_a_fixed_point():
    def fn(c0, c1, xs, ys):
        def body(carry, x_y):
            a, b = carry
            x, y = x_y
            return (a + x, a * 2.0), first_of(b, y)  # b is the previous a; y feeds nothing

        (a, b), out = jax.lax.scan(body, (c0, c1), (xs, ys))
        return b, out

    xs = jnp.ones(3)
    # b (an output) is the previous a: a's initial value and every x are read; c1 is read as the
    # first b; ys never.
    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(0.0, 0.0, xs, xs)) == [True, True, True, False]


def test_used_outputs_select_what_is_live():
    def fn(a, b):
        return a + 1.0, b * 3.0

    jaxpr = jax.make_jaxpr(fn)(1.0, 2.0)
    assert _jaxpr.used_inputs(jaxpr, [True, False]) == [True, False]
    assert _jaxpr.used_inputs(jaxpr, [False, True]) == [False, True]


def test_effects_keep_an_equation_live():
    def fn(a, b):
        jax.debug.print("{}", b)
        return a

    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(1.0, 2.0)) == [True, True]
