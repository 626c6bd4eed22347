"""``auto``: fit a memory budget, with the planner of :mod:`jremat._plan.planner`.

On one checkpointed function, ``auto:budget=B`` keeps the compute ops that save the most
recompute FLOPs while their outputs fit in ``B`` bytes (or the fraction ``B`` of what the
function keeps without remat): :func:`jremat.ops_to_keep_within_budget`. In the CLIs,
``--policy auto --memory-budget B`` plans the whole step with the same algorithm
(:func:`jremat.plan_layers`, wired to the reference model by ``train.planning``).
"""

from __future__ import annotations

from jremat import Budget, Plan, PlanPolicy, Program, ops_to_keep_within_budget, register
from jremat.internal import BUILTIN_PARAMS, as_budget


class BudgetPolicy(PlanPolicy):
    """Keep what :func:`jremat.ops_to_keep_within_budget` chooses for ``budget``."""

    def __init__(self, budget: Budget):
        self.budget = budget

    def plan(self, program: Program) -> Plan:
        return Plan(save=ops_to_keep_within_budget(program, self.budget))


@register(
    "auto",
    doc="Fit a memory budget at the least recompute (jremat.ops_to_keep_within_budget, jremat.plan_layers). On one "
    "function: keep the ops that save the most recompute FLOPs while they fit in budget bytes (or that "
    "fraction of the no-remat residuals). In the CLIs (--policy auto --memory-budget B): pick which names "
    "to save and how many layers to remat so the compiled step's peak fits B.",
    params=BUILTIN_PARAMS["auto"],
)
def auto_policy(budget) -> BudgetPolicy:
    """Build the per-function ``auto`` policy."""
    return BudgetPolicy(as_budget(budget))


#: Alias of :class:`BudgetPolicy`, kept for compatibility.
BudgetPlan = BudgetPolicy
