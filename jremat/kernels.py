"""Kernels jremat did not write: found by name, counted per run, and their forward rule made visible.

A *kernel* is an equation that runs one opaque computation a policy can only keep or re-run whole:

* a ``pallas_call``, named by its ``name`` parameter (JAX's Pallas flash attention
  ``jax.experimental.pallas.ops.gpu.attention.mha`` runs one named ``mha_forward``);
* an FFI custom call (``jax.ffi.ffi_call``), named by its target;
* JAX's cuDNN attention forward primitive (``jax.nn.dot_product_attention(...,
  implementation="cudnn")``), named by the primitive;
* the forward loop of :func:`jremat.attention.blockwise_attention`, named ``blockwise_attention``;
* the loop of a ``custom_vjp`` (forward rule) or ``custom_jvp`` (primal) function with no Pallas or
  FFI call inside (a kernel written in JAX: a scan over key blocks with an online softmax), named
  by the function's name.

:func:`count_kernel_runs` counts each kernel's runs in a traced program (a gradient's jaxpr), by
name, after dead-code elimination. :func:`kernel_reruns` compares two such counts: the kernels a
policy's gradient runs more often than the gradient without remat does.

These kernels are ``custom_vjp`` functions whose forward rule returns the output and residuals
(for attention, a float32 log-sum-exp) to the backward rule; the caller sees only the output. No
policy can name the residuals, and under ``jax_remat3`` a ``custom_vjp`` call is recomputed
whole, forward rule included, so a checkpointed layer runs the kernel again in its backward pass.
:func:`split_kernels` rewrites such a call the way :func:`jremat.attention.blockwise_attention` is
built: the forward rule runs in the ordinary program on gradient-stopped inputs, its residuals
become ordinary values (those that are not the call's inputs tagged
:data:`jremat.names.KERNEL_RESIDUALS`) that a policy can keep, and a ``custom_vjp`` that returns the
output feeds them to the kernel's own backward rule. The values and gradients are the kernel's;
only what is visible to a policy changes. ``selective`` splits attention kernels
(:func:`split_attention_kernels`: a Pallas kernel named like attention, a loop with an online
softmax, or a kernel declared ``attention=True`` with :func:`jremat.register_kernel`); ``names`` and
``names_except`` split every kernel.
"""

from jremat._program.kernels import ATTENTION_KINDS as ATTENTION_KINDS
from jremat._program.kernels import ATTENTION_WORDS as ATTENTION_WORDS
from jremat._program.kernels import BACKWARD_WORDS as BACKWARD_WORDS
from jremat._program.kernels import BLOCKWISE as BLOCKWISE
from jremat._program.kernels import BLOCKWISE_FORWARD_SCOPE as BLOCKWISE_FORWARD_SCOPE
from jremat._program.kernels import CUDNN as CUDNN
from jremat._program.kernels import CUDNN_FORWARD_PRIMITIVES as CUDNN_FORWARD_PRIMITIVES
from jremat._program.kernels import CUSTOM as CUSTOM
from jremat._program.kernels import CUSTOM_ATTENTION as CUSTOM_ATTENTION
from jremat._program.kernels import FFI_CALL as FFI_CALL
from jremat._program.kernels import PALLAS as PALLAS
from jremat._program.kernels import PALLAS_CALL as PALLAS_CALL
from jremat._program.kernels import SPLIT_FORWARD_SCOPE as SPLIT_FORWARD_SCOPE
from jremat._program.kernels import avoid_rerun_advice as avoid_rerun_advice
from jremat._program.kernels import count_grouped_matmuls as count_grouped_matmuls
from jremat._program.kernels import count_kernel_runs as count_kernel_runs
from jremat._program.kernels import custom_kernels as custom_kernels
from jremat._program.kernels import holds_attention_kernel as holds_attention_kernel
from jremat._program.kernels import is_attention_call as is_attention_call
from jremat._program.kernels import is_attention_forward_kernel as is_attention_forward_kernel
from jremat._program.kernels import kernel_at as kernel_at
from jremat._program.kernels import kernel_name as kernel_name
from jremat._program.kernels import kernel_rerun_lines as kernel_rerun_lines
from jremat._program.kernels import kernel_reruns as kernel_reruns
from jremat._program.kernels import split_attention_kernels as split_attention_kernels
from jremat._program.kernels import split_kernels as split_kernels

__all__ = [
    "ATTENTION_KINDS",
    "ATTENTION_WORDS",
    "avoid_rerun_advice",
    "BACKWARD_WORDS",
    "BLOCKWISE",
    "BLOCKWISE_FORWARD_SCOPE",
    "count_grouped_matmuls",
    "count_kernel_runs",
    "CUDNN",
    "CUDNN_FORWARD_PRIMITIVES",
    "CUSTOM",
    "CUSTOM_ATTENTION",
    "custom_kernels",
    "FFI_CALL",
    "holds_attention_kernel",
    "is_attention_call",
    "is_attention_forward_kernel",
    "kernel_at",
    "kernel_name",
    "kernel_rerun_lines",
    "kernel_reruns",
    "PALLAS",
    "PALLAS_CALL",
    "split_attention_kernels",
    "SPLIT_FORWARD_SCOPE",
    "split_kernels",
]
