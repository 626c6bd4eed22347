"""Which attention forward kernels a traced program runs: the analysis behind
:func:`jremat.attention.count_forward_passes` and :func:`jremat.attention.forward_kernel`.

Kernels are found by :mod:`jremat.kernels` (a :func:`jremat.attention.blockwise_attention` forward
loop, cuDNN's forward primitive, a Pallas attention kernel, a ``custom_vjp`` attention kernel written
in JAX) and counted over the equations dead-code elimination leaves
(:func:`jremat._engine.jaxpr.live_equations`: calls and ``scan`` carries to a fixed point).
"""

from __future__ import annotations

from jremat._engine import jaxpr as _jaxpr
from jremat._program import kernels

#: The ``jax.named_scope`` around :func:`jremat.attention.blockwise_attention`'s forward loop;
#: :func:`count_forward_passes` finds it.
FORWARD_SCOPE = kernels.BLOCKWISE_FORWARD_SCOPE
#: Primitives of ``jax.nn.dot_product_attention(..., implementation="cudnn")``'s forward kernel.
CUDNN_FORWARD_PRIMITIVES = _jaxpr.CUDNN_FORWARD_PRIMITIVES


def count_forward_passes(closed_jaxpr, *, loop_iterations: bool = False) -> int:
    """How many attention forward kernels a traced program runs.

    Counts each loop of :func:`jremat.attention.blockwise_attention`'s forward pass (found by its
    ``jax.named_scope``, :data:`FORWARD_SCOPE`), each cuDNN forward kernel of
    ``jax.nn.dot_product_attention(..., implementation="cudnn")``
    (:data:`CUDNN_FORWARD_PRIMITIVES`) and each Pallas attention forward kernel
    (:func:`jremat.kernels.is_attention_forward_kernel`: ``mha_forward`` of
    :func:`jremat.attention.pallas_attention`), over the program and every jaxpr nested in it
    (``jit``, ``scan``, ``while``, ``cond``, checkpoints, custom derivatives). A kernel inside a
    loop body counts once, not once per iteration, unless ``loop_iterations``: then a kernel
    inside a ``scan`` (a layer stack) counts once per iteration (a ``while`` loop's trip count is
    unknown: once). Only kernels whose results the program's outputs use count (a ``scan``'s
    carries followed to a fixed point): under ``jax_remat3`` a saved value's recomputation stays in the jaxpr as an unused
    input of a call (it supplies a tangent that is zero here), and XLA removes it.

    ``jax.value_and_grad`` of a loss over one attention call counts 1 when the backward pass
    reads the saved output and log-sum-exp, 2 when it runs the forward kernel again.
    (``jax.grad`` alone discards the loss, so a recomputing backward pass is then the only
    forward kernel left.)

    Args:
      closed_jaxpr: a ``jax.make_jaxpr`` result (a ``ClosedJaxpr``) or a ``Jaxpr``.
      loop_iterations: count a kernel inside a ``scan`` once per iteration.

    Returns:
      The number of forward kernels.
    """
    kinds: dict = {}
    runs = kernels.count_kernel_runs(closed_jaxpr, loop_iterations=loop_iterations, kinds=kinds)
    return sum(n for name, n in runs.items() if kinds[name] in FORWARD_KINDS)


#: What :func:`forward_kernel` returns for each kind of attention forward kernel.
BLOCKWISE = kernels.BLOCKWISE
CUDNN = kernels.CUDNN
PALLAS = kernels.PALLAS
#: The kinds :func:`count_forward_passes` counts.
FORWARD_KINDS = frozenset({BLOCKWISE, CUDNN, PALLAS})


def forward_kernel(eqn) -> str | None:
    """Which attention forward kernel equation ``eqn`` is or holds (a call or loop that runs
    one): :data:`BLOCKWISE` (a :func:`jremat.attention.blockwise_attention` forward loop), :data:`CUDNN` (a
    cuDNN forward kernel), :data:`PALLAS` (a Pallas attention forward kernel,
    :func:`jremat.kernels.is_attention_forward_kernel`), :data:`jremat.kernels.CUSTOM_ATTENTION`
    (the forward loop of a ``custom_vjp`` attention kernel written in JAX, as
    :func:`jremat.kernels.split_attention_kernels` runs it), or ``None``."""
    return _forward_kernel(eqn, inside_scope=False)


def _forward_kernel(eqn, inside_scope: bool) -> str | None:
    in_scope = inside_scope or FORWARD_SCOPE in str(eqn.source_info.name_stack)
    found = kernels.kernel_at(eqn, in_scope)
    if found is not None:
        return found[1] if found[1] in kernels.ATTENTION_KINDS else None
    if eqn.primitive.name == _jaxpr.PALLAS_CALL:  # not into another kernel's body
        return None
    for sub in _jaxpr.nested_jaxprs(eqn):
        for inner in sub.eqns:
            kind = _forward_kernel(inner, in_scope)
            if kind is not None:
                return kind
    # A custom_vjp attention kernel written in JAX, not split (the split runs its forward loop in
    # the program, where kernel_at finds it).
    return kernels.CUSTOM_ATTENTION if kernels.is_attention_call(eqn) else None
