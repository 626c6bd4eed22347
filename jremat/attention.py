"""Memory-efficient (blockwise) self-attention whose backward pass keeps only its inputs, its output
and one float32 log-sum-exp per query.

:func:`blockwise_attention` computes softmax attention one key block at a time with a running
maximum and sum (Rabe & Staats, 2021) and differentiates it FlashAttention-2 style: the backward
pass recomputes each block's probabilities from the queries, keys and the saved log-sum-exp, so
no ``[seq, seq]`` tensor exists in either pass. Causal attention skips key blocks that lie
entirely in a query block's future. Attention dropout regenerates its masks in the backward pass
from the dropout key, bit-identical to the masks :func:`reference_attention` (and
:func:`jremat.dropout`) draw over the whole ``[batch, heads, seq, seq]`` probabilities.

The kernel tags its output :data:`jremat.names.ATTN_CONTEXT` and its log-sum-exp
:data:`jremat.names.ATTN_LSE`: a checkpoint policy that saves both (for instance
``jax.checkpoint_policies.save_only_these_names("attn_context", "attn_lse")``) does not run the
kernel's forward pass again in the backward pass. :func:`count_forward_passes` counts how many
times a traced program runs an attention forward kernel.
"""

from jremat._attention.functions import BLOCKWISE as BLOCKWISE
from jremat._attention.functions import CUDNN as CUDNN
from jremat._attention.functions import CUDNN_FORWARD_PRIMITIVES as CUDNN_FORWARD_PRIMITIVES
from jremat._attention.functions import FORWARD_KINDS as FORWARD_KINDS
from jremat._attention.functions import FORWARD_SCOPE as FORWARD_SCOPE
from jremat._attention.functions import HIGHER_ORDER_MESSAGE as HIGHER_ORDER_MESSAGE
from jremat._attention.functions import PALLAS as PALLAS
from jremat._attention.functions import PALLAS_BACKWARD_BLOCK as PALLAS_BACKWARD_BLOCK
from jremat._attention.functions import blockwise_attention as blockwise_attention
from jremat._attention.functions import count_forward_passes as count_forward_passes
from jremat._attention.functions import forward_kernel as forward_kernel
from jremat._attention.functions import pallas_attention as pallas_attention
from jremat._attention.functions import pallas_block_sizes as pallas_block_sizes
from jremat._attention.functions import reference_attention as reference_attention

__all__ = [
    "BLOCKWISE",
    "blockwise_attention",
    "count_forward_passes",
    "CUDNN",
    "CUDNN_FORWARD_PRIMITIVES",
    "forward_kernel",
    "FORWARD_KINDS",
    "FORWARD_SCOPE",
    "HIGHER_ORDER_MESSAGE",
    "PALLAS",
    "pallas_attention",
    "PALLAS_BACKWARD_BLOCK",
    "pallas_block_sizes",
    "reference_attention",
]
