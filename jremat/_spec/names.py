"""The implementation of :mod:`jremat.names` (its public names are re-exported there)."""

import contextlib
import contextvars

from jremat._spec.errors import PolicyDoesNotApply

BLOCK_INPUT = "block_input"
LN1_OUT = "ln1_out"
QUERY = "q"
KEY = "k"
VALUE = "v"
ATTN_SCORES = "attn_scores"
ATTN_PROBS = "attn_probs"
ATTN_CONTEXT = "attn_context"
ATTN_OUT = "attn_out"
LN2_OUT = "ln2_out"
MLP_IN = "mlp_in"
MLP_ACT = "mlp_act"
MLP_OUT = "mlp_out"
BLOCK_OUTPUT = "block_output"
#: The float32 log-sum-exp ``[batch, heads, seq]`` that :func:`jremat.attention.blockwise_attention` keeps
#: for its backward pass (beside its output, tagged :data:`ATTN_CONTEXT`).
ATTN_LSE = "attn_lse"
#: The residuals a kernel's ``custom_vjp`` forward rule hands its backward rule (not its inputs:
#: its output, its statistics), tagged where a policy splits the call (:func:`jremat.kernels.split_kernels`):
#: ``names:save=kernel_residuals`` keeps them, so the kernel runs once.
KERNEL_RESIDUALS = "kernel_residuals"

#: Every name a model may tag, in program order of a pre-LayerNorm transformer block.
ALL_NAMES: tuple[str, ...] = (
    BLOCK_INPUT,
    LN1_OUT,
    QUERY,
    KEY,
    VALUE,
    ATTN_SCORES,
    ATTN_PROBS,
    ATTN_CONTEXT,
    ATTN_LSE,
    ATTN_OUT,
    LN2_OUT,
    MLP_IN,
    MLP_ACT,
    MLP_OUT,
    BLOCK_OUTPUT,
)

#: A mixture-of-experts FFN's tensors (the MoE option of the reference model), in program order:
#: the router's logits ``[tokens, experts]``; the tokens sorted by expert (the grouped matmuls'
#: input); each expert's hidden layer before its activation (in a gated MLP such as SwiGLU, the
#: gate projection) and, in a gated MLP, the up projection the activated gate multiplies; the
#: hidden layer after the activation; the experts' outputs
#: (still sorted by expert); and the combined output, back in token order and weighted by the
#: router.
MOE_ROUTER_LOGITS = "moe_router_logits"
MOE_DISPATCHED = "moe_dispatched"
MOE_HIDDEN_PRE_ACT = "moe_hidden_pre_act"
MOE_HIDDEN_UP = "moe_hidden_up"
MOE_HIDDEN = "moe_hidden"
MOE_EXPERT_OUT = "moe_expert_out"
MOE_COMBINED = "moe_combined"

#: Every name an MoE FFN may tag, in program order.
MOE_NAMES: tuple[str, ...] = (
    MOE_ROUTER_LOGITS,
    MOE_DISPATCHED,
    MOE_HIDDEN_PRE_ACT,
    MOE_HIDDEN_UP,
    MOE_HIDDEN,
    MOE_EXPERT_OUT,
    MOE_COMBINED,
)

#: The attention core that Megatron-style selective recomputation recomputes:
#: scores, softmax, attention dropout and probabilities-times-V.
ATTENTION_CORE: tuple[str, ...] = (ATTN_SCORES, ATTN_PROBS)


_DEFERRED: contextvars.ContextVar = contextvars.ContextVar("jremat_deferred_name_checks", default=None)


@contextlib.contextmanager
def deferred_name_checks():
    """Check tag names over a group of checkpoints instead of each one.

    A layer stack checkpointed per sublayer applies one policy to the attention and the MLP
    sublayer; a name tagged in only one of them is valid. Inside this context,
    :func:`check_found` records what each checkpoint wanted and found, and on exit a name is
    an error only if no checkpoint of the group tags it.

    Raises:
      ValueError: on exit, for a name no checkpoint in the group tags.
    """
    records: list = []
    token = _DEFERRED.set(records)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
    found_by_request: dict = {}
    satisfied: dict = {}
    for record in records:
        if record[0] == _REQUIREMENT:
            _, key, ok, message = record
            previous = satisfied.get(key, (False, message))
            satisfied[key] = (previous[0] or ok, message)
            continue
        wanted, found, policy, key = record
        found_by_request.setdefault((wanted, policy, key), set()).update(found)
    for (wanted, policy, key), found in found_by_request.items():
        require_found(wanted, found, policy=policy, key=key)
    for ok, message in satisfied.values():
        if not ok:
            raise PolicyDoesNotApply(message)


_REQUIREMENT = "requirement"


def check_requirement(key, satisfied: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``satisfied``; inside :func:`deferred_name_checks`, only
    if no checkpoint of the group with the same ``key`` satisfied it (an MLP sublayer needs no
    attention core when its attention sublayer has one).

    Raises:
      PolicyDoesNotApply: (a ``ValueError``) ``message``, now or at the end of the enclosing group.
    """
    records = _DEFERRED.get()
    if records is not None:
        records.append((_REQUIREMENT, key, satisfied, message))
    elif not satisfied:
        raise PolicyDoesNotApply(message)


def check_found(wanted, found, *, policy: str, key: str) -> None:
    """:func:`require_found` now, or at the end of the enclosing :func:`deferred_name_checks`."""
    records = _DEFERRED.get()
    if records is None:
        require_found(wanted, found, policy=policy, key=key)
    else:
        records.append((tuple(wanted), frozenset(found), policy, key))


def require_found(wanted, found, *, policy: str, key: str) -> tuple[str, ...]:
    """Check that every tag in ``wanted`` is among the ``checkpoint_name`` tags ``found``.

    Any tag a traced function uses is valid, not only the names above: a policy may refer to a
    user's own tensor names.

    Args:
      wanted: the tags a policy refers to.
      found: the tags present in the traced function.
      policy: the policy's name, for the message.
      key: the spec key that listed the tags (``save``, ``exclude``, ``names``).

    Returns:
      ``wanted`` as a tuple.

    Raises:
      ValueError: if a tag matched nothing; the message lists the tags found.
    """
    wanted = tuple(wanted)
    missing = [n for n in wanted if n not in found]
    if missing:
        listed = ", ".join(sorted(found)) if found else "none (tag values with jax.ad_checkpoint.checkpoint_name)"
        raise PolicyDoesNotApply(
            f"policy {policy!r}: {key}= names {', '.join(map(repr, missing))}, which the checkpointed function "
            f"does not tag; tags it has: {listed}"
        )
    return wanted
