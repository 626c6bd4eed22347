"""``selective``: Megatron-LM's selective activation recomputation.

Korthikanti et al. (2022) keep every activation of a transformer layer except the *attention
core*: the scores ``q·kᵀ`` (with scale and causal mask), the softmax, the attention dropout and
the probabilities-times-``V`` product. Those are the ``[batch, heads, seq, seq]`` tensors, by
far the largest per byte of compute, and are recomputed in the backward pass from the saved
``q``, ``k``, ``v``.

The core is found from the model's tensor names (:mod:`jremat.names`): it is every equation of
the traced program that lies on a data path from a value tagged ``q``, ``k`` or ``v`` to a value
tagged ``attn_context`` (the paths are not followed past those tags, so several attention
layers in one checkpoint each get their own core). Every other computed value is saveable;
JAX then keeps those the backward pass needs. Values derived only from PRNG keys (dropout masks)
are never saved: they are regenerated from the threaded key. A checkpointed function without
attention (an MLP sublayer) is left with everything saveable, like ``none``.
"""

from __future__ import annotations

from jax.extend import core as jcore

from jremat import Plan, PlanPolicy, Program, names, register

#: Names of the attention core's inputs (paths start after them) and output (paths end at it).
CORE_INPUTS = (names.QUERY, names.KEY, names.VALUE)
CORE_OUTPUT = names.ATTN_CONTEXT


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


def attention_core(program: Program) -> frozenset[int]:
    """Equation indices of the attention core(s) of ``program`` (see the module docstring).

    Raises:
      ValueError: if the program tags attention-core tensors (:data:`jremat.names.ATTENTION_CORE`)
        but not the core's boundary (``q``, ``k``, ``v`` and ``attn_context``), so that the core
        cannot be delimited.
    """
    eqns = program.closed_jaxpr.jaxpr.eqns

    def tagged(name_set):
        return {i for i, e in enumerate(eqns) if e.primitive.name == "name" and e.params["name"] in name_set}

    starts, ends = tagged(CORE_INPUTS), tagged({CORE_OUTPUT})
    if not starts and not ends:
        if tagged(set(names.ATTENTION_CORE)):
            raise ValueError(
                "policy 'selective': the function tags attention-core tensors "
                f"({', '.join(names.ATTENTION_CORE)}) but not the core's inputs and output; tag them "
                f"with checkpoint_name as {', '.join(CORE_INPUTS)} and {CORE_OUTPUT} (jremat.names)"
            )
        return frozenset()
    if not starts or not ends:
        missing = ", ".join(CORE_INPUTS) if not starts else CORE_OUTPUT
        raise ValueError(
            f"policy 'selective': the function tags only one side of the attention core; tag {missing} "
            "with checkpoint_name too (jremat.names), or use another policy"
        )
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    consumers: dict = {}
    for i, e in enumerate(eqns):
        for v in filter(_is_var, e.invars):
            consumers.setdefault(v, []).append(i)

    downstream: set[int] = set()  # reached forwards from q/k/v, not past attn_context
    stack = [j for i in starts for v in eqns[i].outvars for j in consumers.get(v, ())]
    while stack:
        i = stack.pop()
        if i in downstream or i in starts:
            continue
        downstream.add(i)
        if i in ends:
            continue
        stack += [j for v in eqns[i].outvars for j in consumers.get(v, ())]
    upstream: set[int] = set()  # reached backwards from attn_context, not past q/k/v
    stack = [producer[v] for i in ends for v in filter(_is_var, eqns[i].invars) if v in producer]
    while stack:
        i = stack.pop()
        if i in upstream or i in starts or i in ends:
            continue
        upstream.add(i)
        stack += [producer[v] for v in filter(_is_var, eqns[i].invars) if v in producer]
    return frozenset(downstream & upstream)


class Selective(PlanPolicy):
    """Save everything except the attention core; never save dropout masks."""

    def plan(self, program: Program) -> Plan:
        core = attention_core(program)
        return Plan(
            save=frozenset(
                op.index
                for op in program.ops
                if (op.counted or op.primitive == "name") and not op.rng_derived and op.index not in core
            )
        )


@register(
    "selective",
    doc="Megatron-style selective recomputation: save everything except the attention core (scores, "
    "softmax, attention dropout, probabilities x V: every op between the q/k/v tags and the "
    "attn_context tag), which is recomputed from the saved q, k, v; dropout masks are never saved.",
)
def selective_policy() -> Selective:
    """Build the ``selective`` policy."""
    return Selective()
