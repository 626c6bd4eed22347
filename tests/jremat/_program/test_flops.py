"""jremat._program.flops: cost-model FLOPs of a traced program, loop iterations and recomputation counted."""

import jax
import jax.numpy as jnp

import jremat
from jremat._engine import jaxpr as _jaxpr
from jremat._program import flops


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


# --- Grouped matmuls (a mixture of experts' expert layers) --------------------------------------

ROWS, CONTRACTED, FREE, GROUPS = 24, 16, 32, 4
GROUP_SIZES = jnp.array([3, 9, 0, 12], jnp.int32)


def _grouped_matmul_equations(fn, *args) -> dict:
    """Output shape -> the cost model's FLOPs, for every grouped matmul equation of ``fn``'s
    value and gradient (every nested jaxpr walked; a kernel's body not entered)."""
    found = {}
    jaxpr = jax.make_jaxpr(jax.value_and_grad(fn, argnums=(0, 1)))(*args).jaxpr
    for eqn in _jaxpr.equations(jaxpr, enter=lambda e, _: e.primitive.name not in _jaxpr.KERNEL_PRIMITIVES):
        if eqn.primitive.name == "ragged_dot_general" or eqn.primitive.name == "pallas_call":
            found[tuple(eqn.outvars[0].aval.shape)] = flops.equation_flops(eqn)
    return found


def test_a_grouped_matmul_costs_its_work_in_every_layout_its_gradient_runs():
    """The forward ``[m, k] x [g, k, n] -> [m, n]``, the rows' gradient ``[m, n] x [g, k, n] ->
    [m, k]`` and the weights' gradient (the ragged dimension contracted: ``[m, k] x [m, n] ->
    [g, k, n]``) each cost 2 x m x k x n, the work of all groups together."""
    lhs = jnp.ones((ROWS, CONTRACTED))
    rhs = jnp.ones((GROUPS, CONTRACTED, FREE))
    found = _grouped_matmul_equations(lambda rows, w: jnp.sum(jax.lax.ragged_dot(rows, w, GROUP_SIZES) ** 2), lhs, rhs)
    work = 2 * ROWS * CONTRACTED * FREE
    assert found == {(ROWS, FREE): work, (ROWS, CONTRACTED): work, (GROUPS, CONTRACTED, FREE): work}


def test_a_grouped_matmul_whose_ragged_dimension_is_a_batch_one_costs_its_work():
    """The third layout of ``ragged_dot_general``: the ragged dimension a batch dimension
    (``[b, m, k] x [b, k, n] -> [b, m, n]``, batches grouped): 2 x b x m x k x n, as a batched
    matmul (JAX gives it no gradient, so its forward is priced alone)."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [1]), ([0], [0])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    lhs, rhs = jnp.ones((6, ROWS, CONTRACTED)), jnp.ones((6, CONTRACTED, FREE))
    batch_sizes = jnp.array([2, 4], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda rows, w: jax.lax.ragged_dot_general(rows, w, batch_sizes, numbers))(lhs, rhs).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general"]
    assert flops.equation_flops(eqn) == 2 * 6 * ROWS * CONTRACTED * FREE


def test_a_megablox_grouped_matmul_kernel_costs_its_work(megablox_promotion):
    """JAX's Pallas grouped matmul (megablox ``gmm`` and, in its gradient, ``tgmm``) is priced by
    its cost estimate: 2 x m x k x n per kernel, as the primitive."""
    from tests.jremat.moe_user_models import megablox_gmm

    lhs = jnp.ones((ROWS, CONTRACTED))
    rhs = jnp.ones((GROUPS, CONTRACTED, FREE))
    sizes = jnp.array([8, 8, 0, 8], jnp.int32)
    found = _grouped_matmul_equations(lambda rows, w: jnp.sum(megablox_gmm(rows, w, sizes) ** 2), lhs, rhs)
    work = 2 * ROWS * CONTRACTED * FREE
    assert found == {(ROWS, FREE): work, (ROWS, CONTRACTED): work, (GROUPS, CONTRACTED, FREE): work}
