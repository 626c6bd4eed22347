"""The one place where intermediate-tensor names are defined.

Models tag tensors with these names through :func:`jax.ad_checkpoint.checkpoint_name`;
policies such as ``names`` and ``selective`` refer to them. Keeping them in one module
means a typo is an import error, not a silently ignored policy.
"""

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
    ATTN_OUT,
    LN2_OUT,
    MLP_IN,
    MLP_ACT,
    MLP_OUT,
    BLOCK_OUTPUT,
)

#: The attention core that Megatron-style selective recomputation recomputes:
#: scores, softmax, attention dropout and probabilities-times-V.
ATTENTION_CORE: tuple[str, ...] = (ATTN_SCORES, ATTN_PROBS)


def validate_names(names, *, what: str = "tensor name") -> tuple[str, ...]:
    """Check that every entry of ``names`` is a known tensor name.

    Args:
      names: iterable of strings.
      what: how the names are described in the error message.

    Returns:
      The names as a tuple, in the order given.

    Raises:
      ValueError: if a name is not in :data:`ALL_NAMES`; the message lists the valid names.
    """
    names = tuple(names)
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        raise ValueError(
            f"unknown {what} {', '.join(map(repr, unknown))}; valid names: {', '.join(ALL_NAMES)}"
        )
    return names
