"""The intermediate-tensor names of jremat's reference model, each defined once here.

The reference model tags its tensors with these names through
:func:`jax.ad_checkpoint.checkpoint_name`, and ``selective`` finds the attention core by them.
The name-based policies (``names``, ``names_except``, ``offload``) accept any tag the traced
function uses, a user's own names included; a name that matches no tag is an error listing the
tags found (:func:`require_found`).
"""

from jremat._spec.names import ALL_NAMES as ALL_NAMES
from jremat._spec.names import ATTENTION_CORE as ATTENTION_CORE
from jremat._spec.names import ATTN_CONTEXT as ATTN_CONTEXT
from jremat._spec.names import ATTN_LSE as ATTN_LSE
from jremat._spec.names import ATTN_OUT as ATTN_OUT
from jremat._spec.names import ATTN_PROBS as ATTN_PROBS
from jremat._spec.names import ATTN_SCORES as ATTN_SCORES
from jremat._spec.names import BLOCK_INPUT as BLOCK_INPUT
from jremat._spec.names import BLOCK_OUTPUT as BLOCK_OUTPUT
from jremat._spec.names import KERNEL_RESIDUALS as KERNEL_RESIDUALS
from jremat._spec.names import KEY as KEY
from jremat._spec.names import LN1_OUT as LN1_OUT
from jremat._spec.names import LN2_OUT as LN2_OUT
from jremat._spec.names import MLP_ACT as MLP_ACT
from jremat._spec.names import MLP_IN as MLP_IN
from jremat._spec.names import MLP_OUT as MLP_OUT
from jremat._spec.names import MOE_COMBINED as MOE_COMBINED
from jremat._spec.names import MOE_DISPATCHED as MOE_DISPATCHED
from jremat._spec.names import MOE_EXPERT_OUT as MOE_EXPERT_OUT
from jremat._spec.names import MOE_HIDDEN as MOE_HIDDEN
from jremat._spec.names import MOE_HIDDEN_PRE_ACT as MOE_HIDDEN_PRE_ACT
from jremat._spec.names import MOE_HIDDEN_UP as MOE_HIDDEN_UP
from jremat._spec.names import MOE_NAMES as MOE_NAMES
from jremat._spec.names import MOE_ROUTER_LOGITS as MOE_ROUTER_LOGITS
from jremat._spec.names import QUERY as QUERY
from jremat._spec.names import VALUE as VALUE
from jremat._spec.names import PolicyDoesNotApply as PolicyDoesNotApply
from jremat._spec.names import check_found as check_found
from jremat._spec.names import check_requirement as check_requirement
from jremat._spec.names import deferred_name_checks as deferred_name_checks
from jremat._spec.names import require_found as require_found

__all__ = [
    "ALL_NAMES",
    "ATTENTION_CORE",
    "ATTN_CONTEXT",
    "ATTN_LSE",
    "ATTN_OUT",
    "ATTN_PROBS",
    "ATTN_SCORES",
    "BLOCK_INPUT",
    "BLOCK_OUTPUT",
    "check_found",
    "check_requirement",
    "deferred_name_checks",
    "KERNEL_RESIDUALS",
    "KEY",
    "LN1_OUT",
    "LN2_OUT",
    "MLP_ACT",
    "MLP_IN",
    "MLP_OUT",
    "MOE_COMBINED",
    "MOE_DISPATCHED",
    "MOE_EXPERT_OUT",
    "MOE_HIDDEN",
    "MOE_HIDDEN_PRE_ACT",
    "MOE_HIDDEN_UP",
    "MOE_NAMES",
    "MOE_ROUTER_LOGITS",
    "PolicyDoesNotApply",
    "QUERY",
    "require_found",
    "VALUE",
]
