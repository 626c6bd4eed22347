"""jremat._flops: cost-model FLOPs of a traced program, loop iterations and recomputation counted."""

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
