"""``every_k``: save the outputs of every k-th compute op, recompute the rest.

This is the Needle study's "keep one node every segment_len nodes". The compute ops of the
checkpointed function are numbered from 0 in program order (its jaxpr, with nested ``jit``
calls inlined; see :mod:`jremat._program.program` for what counts: shape-only ops, name tags and values
derived only from PRNG keys or constants do not). The outputs of ops 0, k, 2k, ... are saved.
``k=1`` saves every compute op (about ``none``); ``k`` above the op count saves only op 0
(about ``full``). With ``skip_cheap=true`` only non-cheap ops are numbered (see
:mod:`policies.skip_cheap`), in the program ``skip_cheap`` sees (an attention kernel's
``custom_vjp`` split, so a numbered kernel keeps its statistics too). A kernel (a
``pallas_call``, an FFI call, a ``custom_vjp`` function that runs one) is one compute op. The
choice is made from the traced program, so it is the same however often JAX calls it.
"""

from __future__ import annotations

from jremat import Plan, PlanPolicy, Program, kernels, register
from jremat.internal import BUILTIN_PARAMS, DEFAULT_MIN_FLOPS_PER_BYTE
from jremat.policies.skip_cheap import is_cheap


class EveryK(PlanPolicy):
    """Save compute ops number 0, k, 2k, ... of the checkpointed function."""

    def __init__(self, k: int, skip_cheap: bool, min_flops_per_byte: float = DEFAULT_MIN_FLOPS_PER_BYTE):
        self.k = k
        self.skip_cheap = skip_cheap
        self.min_flops_per_byte = min_flops_per_byte

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        if self.skip_cheap:
            fn = kernels.split_attention_kernels(fn)
        return super().checkpoint_untied(fn, prevent_cse=prevent_cse)

    def numbered_ops(self, program: Program):
        """The ops this policy numbers, in order (all compute ops, or the non-cheap ones)."""
        ops = program.compute_ops
        if self.skip_cheap:
            ops = tuple(op for op in ops if not is_cheap(op, self.min_flops_per_byte))
        return ops

    def plan(self, program: Program) -> Plan:
        return Plan(save=frozenset(op.index for j, op in enumerate(self.numbered_ops(program)) if j % self.k == 0))


@register(
    "every_k",
    doc="Number the compute ops of the checkpointed function from 0 in program order and save "
    "the outputs of ops 0, k, 2k, ...; recompute the rest. skip_cheap=true numbers only non-cheap ops.",
    params=BUILTIN_PARAMS["every_k"],
)
def every_k_policy(k: int, skip_cheap: bool, min_flops_per_byte: float) -> EveryK:
    """Build the ``every_k`` policy."""
    return EveryK(k, skip_cheap, min_flops_per_byte)
