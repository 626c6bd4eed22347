"""jremat._program.program: which traced ops count as elementwise."""

import jax
import jax.numpy as jnp

import jremat


def test_only_elementwise_primitives_are_elementwise():
    """Arithmetic on same-shaped values is elementwise; a loop, a scan, a split, a concatenate, a
    matmul, a reduction and a custom call are not, whatever their shapes."""

    def fn(x):
        y = jnp.tanh(x) * 2.0 + x
        y = jax.lax.while_loop(lambda c: jnp.sum(c) > 1.0, lambda c: c * 0.5, y)  # same shape
        y, _ = jax.lax.scan(lambda c, _: (jnp.sin(c), None), y, length=2)
        a, b = jnp.split(y, 2, axis=0)
        y = jnp.concatenate([b, a]) @ x
        return jnp.sum(jax.nn.relu(y))

    prog = jremat.trace_program(fn, jnp.ones((4, 4)))
    elementwise = {op.primitive for op in prog.compute_ops if op.is_elementwise}
    others = {op.primitive for op in prog.compute_ops if not op.is_elementwise}
    assert elementwise == {"tanh", "mul", "add"}
    assert {"while", "scan", "split", "concatenate", "dot_general", "reduce_sum", "custom_jvp_call"} <= others
