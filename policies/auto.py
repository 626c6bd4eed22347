"""``auto``: choose what to save from a memory budget.

Two levels use the same cost model as ``skip_cheap`` (recompute FLOPs vs bytes kept):

* On a single checkpointed function, ``auto:budget=B`` keeps the compute ops with the highest
  recompute FLOPs per byte, in that order, while their outputs fit in ``B`` bytes (or in the
  fraction ``B`` of what the function would keep without remat). Taking a prefix of one fixed
  order makes the plan monotonic: a larger budget keeps a superset.
* For a whole train step, :func:`solve` walks candidate plans in order of predicted recompute
  cost, and returns the first whose *compiled* peak fits the budget (``train.auto`` builds the
  candidates for the reference model: which tensor names to save x how many layers to remat).

Budgets are written ``6GiB``, ``512MiB``, ``1.5GB``, ``1000000`` (bytes), or a fraction in
``(0, 1]`` such as ``0.5``: half of the no-remat activation memory.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Generic, Sequence, TypeVar

from jremat import Param, Plan, PlanPolicy, register
from jremat.program import Program

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, or a fraction of the no-remat activation memory.

    Attributes:
      bytes: the budget in bytes, or ``None`` for a fractional budget.
      fraction: in ``(0, 1]``, or ``None`` for an absolute budget.
      text: as the user wrote it.
    """

    bytes: int | None
    fraction: float | None
    text: str

    def resolve(self, none_bytes: int, floor_bytes: int = 0) -> int:
        """Absolute bytes: a fraction ``f`` means ``floor + f * (none_bytes - floor)``.

        Args:
          none_bytes: the memory without remat (a step's peak, or a function's residual bytes).
          floor_bytes: the part a policy cannot change (parameters, optimizer state, ...).
        """
        if self.bytes is not None:
            return self.bytes
        return int(floor_bytes + self.fraction * (none_bytes - floor_bytes))


def parse_budget(text: str) -> Budget:
    """Parse a budget string.

    A number with a unit is a size (``6GiB``, ``1.5GB``: whole bytes). A number without a unit
    is a fraction of the no-remat memory when it is at most 1 (``0.5``, ``1``, ``1.0``: all of
    it) and a byte count when it is a whole number above 1 (``1000000``).

    Raises:
      ValueError: if it is not a positive size with a known unit, a fraction in ``(0, 1]`` or a
        whole number of bytes.
    """
    match = _BUDGET_RE.match(str(text))
    units = "B, KB, MB, GB, KiB, MiB, GiB, TiB"
    form = (
        f"a size like 6GiB or 512MiB (units {units}), a whole number of bytes like 1000000, "
        "or a fraction in (0, 1] of the no-remat memory like 0.5"
    )
    if not match:
        raise ValueError(f"memory budget {text!r} is not {form}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"memory budget {text!r}: unknown unit {match.group(2)!r}; valid units: {units}")
    if number <= 0:
        raise ValueError(f"memory budget {text!r} must be positive; expected {form}")
    if not unit and number <= 1.0:
        return Budget(bytes=None, fraction=number, text=str(text).strip())
    size = number * _UNITS[unit]
    if size != int(size):
        raise ValueError(f"memory budget {text!r} is not a whole number of bytes; expected {form}")
    return Budget(bytes=int(size), fraction=None, text=str(text).strip())


class BudgetKnapsack(PlanPolicy):
    """Save the compute ops with the most recompute FLOPs per byte that fit in the budget."""

    def __init__(self, budget: Budget):
        self.budget = budget

    def plan(self, program: Program) -> Plan:
        candidates = [op for op in program.compute_ops if not op.rng_derived and op.out_bytes > 0]
        limit = self.budget.resolve(sum(op.out_bytes for op in candidates))
        # One fixed order (cost per byte, then program order) and a prefix of it: monotonic in budget.
        ordered = sorted(candidates, key=lambda op: (-op.flops_per_byte, op.index))
        kept, used = [], 0
        for op in ordered:
            if used + op.out_bytes > limit:
                break
            kept.append(op.index)
            used += op.out_bytes
        return Plan(save=frozenset(kept))


@register(
    "auto",
    doc="Fit a memory budget. On one function: keep the ops with the most recompute FLOPs per byte "
    "while they fit in budget bytes (or that fraction of the no-remat residuals). In the CLIs "
    "(--policy auto --memory-budget B): pick which names to save and how many layers to remat so "
    "the compiled step's peak fits B, at the least recompute.",
    params={
        "budget": Param(
            "str", "0.5", "a size (6GiB, 512MiB) or a fraction in (0, 1]", parse=parse_budget, format=lambda b: b.text
        )
    },
)
def auto_policy(budget) -> BudgetKnapsack:
    """Build the per-function ``auto`` policy."""
    return BudgetKnapsack(budget if isinstance(budget, Budget) else parse_budget(budget))


C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class Solution(Generic[C]):
    """The plan :func:`solve` chose and what was measured on the way.

    Attributes:
      candidate: the chosen candidate.
      predicted_peak_bytes: the model's prediction for it.
      compiled_peak_bytes: XLA's figure for it.
      recompute_flops: its predicted recompute cost.
      compiled: every ``(candidate, compiled peak)`` measured while solving, in order.
      solve_s: seconds spent ordering and walking candidates, compiles excluded.
      compile_s: seconds spent in ``measure``.
    """

    candidate: C
    predicted_peak_bytes: int
    compiled_peak_bytes: int
    recompute_flops: float
    compiled: tuple
    solve_s: float
    compile_s: float


def solve(
    budget_bytes: int,
    candidates: Sequence[C],
    *,
    predict_peak_bytes: Callable[[C], int],
    recompute_flops: Callable[[C], float],
    measure_peak_bytes: Callable[[C], int],
    describe: Callable[[C], str] = str,
) -> Solution[C]:
    """Cheapest candidate whose compiled peak fits ``budget_bytes``.

    Candidates are reduced to the Pareto frontier of (recompute FLOPs, predicted peak): walked
    in order of rising cost, each kept plan predicts a strictly smaller peak than every cheaper
    one. The walk compiles the first plan predicted to fit; if XLA's peak is over budget it goes
    on to the next (the plan is tightened) until one fits, ending at the smallest-memory plan.
    Because neither the frontier nor its order depends on the budget, a larger budget never
    yields a costlier plan (whatever fit the smaller budget also fits the larger one and is met
    no later in the walk), and the result never exceeds its budget.

    Args:
      budget_bytes: the peak to stay under.
      candidates: the plans to choose from.
      predict_peak_bytes: cheap estimate of a plan's peak.
      recompute_flops: predicted recompute cost of a plan.
      measure_peak_bytes: compiles a plan and returns XLA's peak (cache it if plans repeat).
      describe: names a plan in error messages.

    Returns:
      The :class:`Solution`.

    Raises:
      ValueError: if no candidate fits; the message gives the smallest peak achievable and the
        plan that reaches it.
    """
    start = time.perf_counter()
    compile_s = 0.0
    keyed = sorted(((recompute_flops(c), predict_peak_bytes(c), i) for i, c in enumerate(candidates)))
    frontier = []
    for cost, predicted, i in keyed:
        if not frontier or predicted < frontier[-1][1]:
            frontier.append((cost, predicted, i))
    tried = []
    for cost, predicted, i in frontier:
        if predicted > budget_bytes:
            continue
        t0 = time.perf_counter()
        compiled = int(measure_peak_bytes(candidates[i]))
        compile_s += time.perf_counter() - t0
        tried.append((candidates[i], compiled))
        if compiled <= budget_bytes:
            return Solution(
                candidate=candidates[i],
                predicted_peak_bytes=predicted,
                compiled_peak_bytes=compiled,
                recompute_flops=cost,
                compiled=tuple(tried),
                solve_s=time.perf_counter() - start - compile_s,
                compile_s=compile_s,
            )
    smallest = candidates[frontier[-1][2]]
    smallest_bytes = int(measure_peak_bytes(smallest))
    raise ValueError(
        f"no plan fits the memory budget of {budget_bytes:,} bytes ({budget_bytes / 2**30:.2f} GiB): "
        f"the smallest achievable peak is {smallest_bytes:,} bytes ({smallest_bytes / 2**30:.2f} GiB), "
        f"reached by {describe(smallest)}; raise the budget or reduce the batch size"
    )
