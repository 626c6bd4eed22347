"""jremat._program.flops: cost-model FLOPs of a traced program, loop iterations and recomputation counted."""

import jax
import jax.numpy as jnp

import jremat


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


def test_a_while_loop_over_a_static_range_counts_every_trip():
    """``i = 0; while i < 7: i += 1`` counts its body 7 times; a loop with a traced bound, once."""
    from jax import lax

    from jremat._program import flops as _flops

    x = jnp.ones((4, 4))
    body_flops = _flops.jaxpr_flops(jax.make_jaxpr(lambda x: jnp.sin(x) @ x)(x))
    static = lambda x: lax.while_loop(lambda s: s[0] < 7, lambda s: (s[0] + 1, jnp.sin(s[1]) @ s[1]), (0, x))[1]
    traced = lambda x, n: lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, jnp.sin(s[1]) @ s[1]), (0, x))[1]
    assert _flops.jaxpr_flops(jax.make_jaxpr(static)(x)) >= 7 * body_flops
    assert _flops.jaxpr_flops(jax.make_jaxpr(traced)(x, 7)) < 2 * body_flops
    empty = lambda x: lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.sin(s[1]) @ s[1]), (3, x))[1]
    assert _flops.jaxpr_flops(jax.make_jaxpr(empty)(x)) == 0.0  # a known count of zero runs nothing
