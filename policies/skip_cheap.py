"""``skip_cheap``: keep only values that are expensive to recompute per byte kept.

Cost model (from :func:`jremat._program.flops.equation_flops`): the FLOPs to recompute an op's output
from its inputs divided by the bytes its output takes. Elementwise ops (about one FLOP per
element, i.e. 0.25-0.5 FLOP/byte) and shape-only ops are always cheap; a ``dot_general`` costs
``2 x contracted`` FLOPs per output element, so a matmul over 64 features in bf16 is
64 FLOP/byte. Ops below ``min_flops_per_byte`` are recomputed.

A kernel (a ``pallas_call``, an FFI call, a ``custom_vjp`` function that runs one) costs its
price (:func:`jremat.kernel_cost`: declared, its ``CostEstimate``, its body times its grid, or
expensive if nobody declared it), per byte of its outputs. A ``custom_vjp`` attention kernel's
forward rule runs in the checkpointed program (:func:`jremat.kernels.split_attention_kernels`),
so the output and statistics it hands its backward rule are outputs this policy can keep, and a
kept kernel runs once.
"""

from __future__ import annotations

from jremat import Op, Plan, PlanPolicy, Program, kernels, register
from jremat.internal import BUILTIN_PARAMS, DEFAULT_MIN_FLOPS_PER_BYTE


def is_cheap(op: Op, min_flops_per_byte: float = DEFAULT_MIN_FLOPS_PER_BYTE) -> bool:
    """Whether recomputing ``op`` is cheap: elementwise, or below ``min_flops_per_byte``."""
    return op.is_elementwise or op.flops_per_byte < min_flops_per_byte


class SkipCheap(PlanPolicy):
    """Save every compute op whose recompute cost per byte is at least the threshold."""

    def __init__(self, min_flops_per_byte: float):
        self.min_flops_per_byte = min_flops_per_byte

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        # Keeping an attention kernel's output alone would leave its log-sum-exp to recompute.
        return super().checkpoint_untied(kernels.split_attention_kernels(fn), prevent_cse=prevent_cse)

    def plan(self, program: Program) -> Plan:
        return Plan(save=frozenset(op.index for op in program.compute_ops if not is_cheap(op, self.min_flops_per_byte)))


@register(
    "skip_cheap",
    doc="Never save outputs of cheap ops (elementwise, shape-only, or fewer than "
    "min_flops_per_byte recompute FLOPs per byte kept); save everything costlier, e.g. matmuls.",
    params=BUILTIN_PARAMS["skip_cheap"],
)
def skip_cheap_policy(min_flops_per_byte: float) -> SkipCheap:
    """Build the ``skip_cheap`` policy."""
    return SkipCheap(min_flops_per_byte)
