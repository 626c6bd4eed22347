"""Keep or re-gather: the ``keep_gathered`` key every built-in single-function policy takes.

Under FSDP each weight is stored sharded and gathered where a matmul uses it. A checkpoint that
recomputes its forward in the backward pass gathers every weight again (the all-gather is part of
what it recomputes), and keeping matmul outputs (``dots``) does not keep the gathered weight that
the backward's ``dY @ Wᵀ`` reads. ``keep_gathered=true`` adds those gathered weights to what the
policy saves, found by structure on the checkpoint's jaxpr: the output of a
``sharding_constraint`` whose operand comes from the checkpoint's inputs alone (through shape-only
ops: no activation feeds it) and that feeds a ``dot_general`` (through shape-only ops).

Memory: each checkpoint then keeps its gathered weights (per device, the whole weight where FSDP
stored ``1 / fsdp`` of it) from its forward pass to its backward pass; without remat they are
kept the same way, so the backward's all-gathers return to the count without remat. A weight
XLA gathers implicitly (no sharding constraint in the model) is not a value of the jaxpr and
cannot be kept: constrain it to its gathered placement in the block
(``jax.lax.with_sharding_constraint(w, gathered_sharding)``), as the reference model does with
``GPT(..., weight_sharding=...)``.
"""

from __future__ import annotations

from jax.extend import core as jcore

from jremat import _engine
from jremat._policy import CallbackPolicy, NoRemat, Plan, PlanPolicy, Policy
from jremat._program import Program

#: The spec key that keeps gathered weights.
KEY = "keep_gathered"
#: Primitives that pass a value through without computing (followed both ways from a gather).
_PASS_THROUGH = frozenset(
    {"convert_element_type", "reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "copy", "name"}
)
_CONSTRAINT = "sharding_constraint"


def gathered_weights(program: Program) -> frozenset[int]:
    """Equation indices of ``program`` whose outputs are gathered weights (module docstring).

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      The indices of the ``sharding_constraint`` equations found.
    """
    jaxpr = program.closed_jaxpr.jaxpr
    from_inputs = {v: True for v in jaxpr.invars}
    consumers: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        for v in ins:
            consumers.setdefault(v, []).append(i)
        passes = eqn.primitive.name in _PASS_THROUGH or eqn.primitive.name == _CONSTRAINT
        for v in eqn.outvars:
            from_inputs[v] = passes and bool(ins) and all(from_inputs.get(u, False) for u in ins)

    def feeds_matmul(var, depth: int = 0) -> bool:
        for j in consumers.get(var, ()):
            eqn = jaxpr.eqns[j]
            if eqn.primitive.name == "dot_general":
                return True
            if (
                eqn.primitive.name in _PASS_THROUGH
                and depth < 8
                and any(feeds_matmul(o, depth + 1) for o in eqn.outvars)
            ):
                return True
        return False

    found = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != _CONSTRAINT:
            continue
        operand = eqn.invars[0]
        if from_inputs.get(operand, False) and feeds_matmul(eqn.outvars[0]):
            found.add(i)
    return frozenset(found)


class KeepGathered(PlanPolicy):
    """``inner`` plus the gathered weights of every checkpoint (:func:`gathered_weights`).

    Args:
      inner: a :class:`jremat.CallbackPolicy` or :class:`jremat.PlanPolicy`.

    Raises:
      ValueError: for another kind of policy (a layer-stack policy, ``none``).
    """

    def __init__(self, inner: Policy):
        if not isinstance(inner, (CallbackPolicy, PlanPolicy)):
            raise ValueError(
                f"{KEY}=true applies to a policy of one function (a callback or plan policy), not {inner!r}"
            )
        self.inner = inner
        self.offload_src = getattr(inner, "offload_src", self.offload_src)
        self.offload_dst = getattr(inner, "offload_dst", self.offload_dst)

    def plan(self, program: Program) -> Plan:
        if isinstance(self.inner, PlanPolicy):
            base = self.inner.plan(program)
        else:
            save, offload = _engine.callback_decisions(program.closed_jaxpr, self.inner.callback)
            if offload:
                self.offload_src, self.offload_dst = next(iter(offload.values()))
            base = Plan(save=save, offload=frozenset(offload))
        return Plan(save=base.save | (gathered_weights(program) - base.offload), offload=base.offload)

    def describe_match(self, program: Program) -> list[str]:
        n = len(gathered_weights(program))
        lines = self.inner.describe_match(program)
        if not n:
            return [*lines, "no gathered weight (no sharding constraint on an input that feeds a matmul) to keep"]
        return [*lines, f"keeps {n} gathered weight{'s' if n != 1 else ''} (sharding constraint -> matmul)"]


def with_keep_gathered(policy: Policy, keep: bool) -> Policy:
    """``policy`` wrapped in :class:`KeepGathered` when ``keep``; ``none`` keeps everything already.

    Raises:
      ValueError: as :class:`KeepGathered`.
    """
    if not keep or isinstance(policy, NoRemat):
        return policy
    return KeepGathered(policy)
