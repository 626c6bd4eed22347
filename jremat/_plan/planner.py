"""The memory-budget planner behind the ``auto`` policy, for any function or layered model.

One algorithm, two uses. A *unit* is a value the planner may keep for the backward pass (a tagged
tensor of a block, or a compute op of a function) with its bytes and its recompute FLOPs (the
cost model of ``skip_cheap``). A *candidate* is a set of kept units (:func:`save_sets`: every
subset when there are few units, else the greedy prefixes in order of recompute FLOPs per byte).
:func:`solve` reduces the candidates to the Pareto frontier of (recompute FLOPs, predicted
bytes) and walks it from the cheapest candidate, measuring each one predicted to fit until one does.

Words: the candidate chosen for a layered model, with its numbers, is a *layer plan*
(:class:`LayerPlan`); a plain *plan* is what a plan policy keeps in one traced program
(:class:`jremat.Plan`), as the ``auto:budget=B`` policy does with :func:`ops_to_keep_within_budget`.

* On one checkpointed function (:func:`ops_to_keep_within_budget`, the ``auto:budget=B`` policy): units are
  the function's compute ops, the prediction is the kept bytes and the measurement is the
  prediction (nothing can be compiled while tracing).
* On a layered model (:func:`plan_layers`): units are the block's tagged tensors
  (:func:`name_costs`), a candidate also says how many layers, from the first, are
  rematerialized (the rest keep everything), the prediction is calibrated on two compiles
  (no remat and full remat) and the measurement is a compile of the whole step, supplied by the
  caller (``train.planning`` does it for the reference GPT).

Where the backend has separate host memory (``pinned_host`` on GPU, TPU), a unit that is not
kept on the device is offloaded instead of recomputed when moving its bytes to the host and back
costs less (:func:`jremat.offload_flops_per_byte` prices a byte in FLOP-equivalents,
measured once).

Budgets are written ``6GiB``, ``512MiB``, ``1.5GB``, ``1000000`` (bytes), or a fraction in
``(0, 1]`` such as ``0.5``: half of the no-remat memory (:func:`jremat.parse_budget`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Generic, TypeVar

from jremat._engine import jaxpr as _jaxpr
from jremat._engine import tags as _tags
from jremat._program.program import Program
from jremat._spec import names as tensor_names
from jremat._spec.budget import Budget, as_budget, format_bytes, parse_budget

#: Tagged tensors a layer plan never chooses: the checkpoint's input (kept anyway) and the block's output.
ALWAYS_KEPT = (tensor_names.BLOCK_INPUT, tensor_names.BLOCK_OUTPUT)

#: Up to this many units, :func:`save_sets` lists every subset; above it, greedy prefixes.
EXHAUSTIVE_UNITS = 12


# ---------------------------------------------------------------------------------------------
# Units and candidates
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NameCost:
    """Bytes and recompute FLOPs of one unit (per layer for a block's tagged tensor).

    Attributes:
      name: the tensor name (or, for a function's compute op, its index as text).
      bytes: bytes kept when it is saved.
      recompute_flops: FLOPs from the previous unit up to it, spent again when it is not saved.
      offload_flops: FLOP-equivalents of moving it to host memory and back, or ``None``.
    """

    name: str
    bytes: int
    recompute_flops: float
    offload_flops: float | None = None

    @property
    def offloaded(self) -> bool:
        """Whether offloading this unit (when not saved) is cheaper than recomputing it."""
        return self.offload_flops is not None and self.offload_flops < self.recompute_flops

    @property
    def unsaved_flops(self) -> float:
        """The cost of not saving it on the device: recompute or offload, whichever is cheaper."""
        return self.offload_flops if self.offload_flops is not None and self.offloaded else self.recompute_flops


def name_costs(program: Program, *, skip: Collection[str] = ALWAYS_KEPT) -> tuple[NameCost, ...]:
    """Bytes and recompute FLOPs of each tensor ``program`` tags, in program order.

    A tagged tensor's recompute cost is the FLOPs of the ops from the previous tagged value up
    to it. Tags a plan policy adds (``jremat3/17``) are not tensors of the model and are passed.

    Args:
      program: the traced block (:func:`jremat.trace_program` of it, without remat).
      skip: names never offered to the plan (they still end a segment).
    """
    costs, segment_flops = [], 0.0
    for op in program.ops:
        segment_flops += op.flops
        if op.primitive == _jaxpr.NAME and op.tensor_name and not _tags.is_internal(op.tensor_name):
            if op.tensor_name not in skip:
                costs.append(NameCost(op.tensor_name, op.out_bytes, segment_flops))
            segment_flops = 0.0
    return tuple(costs)


def save_sets(units: Sequence[NameCost], exhaustive_up_to: int = EXHAUSTIVE_UNITS) -> list[tuple[str, ...]]:
    """The candidate kept sets: every subset of ``units`` if there are at most ``exhaustive_up_to``, else greedy prefixes.

    The greedy prefixes take the units in order of recompute FLOPs per byte (highest first, then
    program order): ``len(units) + 1`` sets, each a superset of the previous.
    """
    names = [u.name for u in units]
    if len(units) <= exhaustive_up_to:
        return [s for r in range(len(names) + 1) for s in itertools.combinations(names, r)]
    ordered = sorted(range(len(units)), key=lambda i: (-units[i].recompute_flops / max(units[i].bytes, 1), i))
    return [tuple(names[i] for i in sorted(ordered[:k])) for k in range(len(units) + 1)]


# ---------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------

C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class Solution(Generic[C]):
    """The plan :func:`solve` chose and what was measured on the way.

    Attributes:
      candidate: the chosen candidate.
      predicted_peak_bytes: the model's prediction for it.
      compiled_peak_bytes: the measured figure for it.
      recompute_flops: its predicted recompute cost.
      compiled: every ``(candidate, measured peak)`` taken while solving, in order.
      solve_s: seconds spent ordering and walking candidates, measurements excluded.
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
    """Cheapest candidate whose measured peak fits ``budget_bytes``.

    Candidates are reduced to the Pareto frontier of (recompute FLOPs, predicted peak): walked
    in order of rising cost, each kept plan predicts a strictly smaller peak than every cheaper
    one. The walk measures the first plan predicted to fit; if the measurement is over budget it
    goes on to the next (the plan is tightened) until one fits, ending at the smallest-memory
    plan. Because neither the frontier nor its order depends on the budget, a larger budget
    never yields a costlier plan (whatever fit the smaller budget also fits the larger one and is
    met no later in the walk), and the result never exceeds its budget.

    Args:
      budget_bytes: the peak to stay under.
      candidates: the plans to choose from.
      predict_peak_bytes: cheap estimate of a plan's peak.
      recompute_flops: predicted recompute cost of a plan.
      measure_peak_bytes: the peak that counts (a compile; cache it if plans repeat).
      describe: names a plan in error messages.

    Raises:
      ValueError: if no candidate fits; the message gives the smallest peak achievable and the
        plan that reaches it.
    """
    start = time.perf_counter()
    compile_s = 0.0
    keyed = sorted(((recompute_flops(c), predict_peak_bytes(c), i) for i, c in enumerate(candidates)))
    frontier: list[tuple[float, int, int]] = []
    for cost, predicted, i in keyed:
        if not frontier or predicted < frontier[-1][1]:
            frontier.append((cost, predicted, i))
    tried = []
    for cost, predicted, i in frontier:
        if predicted > budget_bytes:
            continue
        t0 = time.perf_counter()
        measured = int(measure_peak_bytes(candidates[i]))
        compile_s += time.perf_counter() - t0
        tried.append((candidates[i], measured))
        if measured <= budget_bytes:
            return Solution(
                candidate=candidates[i],
                predicted_peak_bytes=predicted,
                compiled_peak_bytes=measured,
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


# ---------------------------------------------------------------------------------------------
# One function
# ---------------------------------------------------------------------------------------------


def ops_to_keep_within_budget(program: Program, budget: str | Budget) -> frozenset[int]:
    """The compute ops of one checkpointed function to keep under ``budget`` (op indices).

    Units are the compute ops (outputs of PRNG-only ops are always recomputed); a fractional
    budget is that fraction of the bytes every unit would keep. The kept bytes are the
    prediction and the measurement, so the result fits exactly, and a larger budget keeps at
    least as many bytes at no more recompute.
    """
    budget = as_budget(budget)
    ops = [op for op in program.compute_ops if not op.rng_derived and op.out_bytes > 0]
    units = [NameCost(str(op.index), op.out_bytes, op.flops) for op in ops]
    by_name = {u.name: u for u in units}
    total_flops = sum(u.recompute_flops for u in units)
    limit = budget.resolve(sum(u.bytes for u in units))

    def kept(save: tuple[str, ...]) -> int:
        return sum(by_name[n].bytes for n in save)

    solution = solve(
        limit,
        save_sets(units),
        predict_peak_bytes=kept,
        recompute_flops=lambda save: total_flops - sum(by_name[n].recompute_flops for n in save),
        measure_peak_bytes=kept,
    )
    return frozenset(int(n) for n in solution.candidate)


#: Alias of :func:`ops_to_keep_within_budget`, kept for compatibility.
plan_function = ops_to_keep_within_budget


# ---------------------------------------------------------------------------------------------
# A layered model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layer plan: the names saved (and offloaded) in rematerialized layers, and how many layers."""

    save: tuple[str, ...]
    remat_layers: int
    offload: tuple[str, ...] = ()
    keep_gathered: bool = False
    #: The spec key that keeps a rematerialized layer's collectives: ``keep_gathered`` (FSDP's
    #: gathered weights) or ``keep_collectives`` (every collective, an expert-parallel MoE's
    #: all-to-alls too).
    keep_key: str = "keep_gathered"

    def spec(self) -> str:
        """The policy spec of a rematerialized layer."""
        if self.offload:
            spec = "offload:names=" + "+".join(self.offload) + (",save=" + "+".join(self.save) if self.save else "")
        else:
            spec = "names:save=" + "+".join(self.save) if self.save else "full"
        if self.keep_gathered:  # keep the layer's gathered weights or collectives (a mesh)
            spec += (":" if spec == "full" else ",") + f"{self.keep_key}=true"
        return spec

    def describe(self, n_layers: int) -> str:
        """A one-line description."""
        if self.remat_layers == 0:
            return "none (no remat)"
        return f"{self.spec()} on layers 0..{self.remat_layers - 1} of {n_layers}" + (
            "" if self.remat_layers == n_layers else ", none on the rest"
        )


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What :func:`plan_layers` chose, with the numbers behind it.

    Attributes:
      config: ``apply(candidate)``: the caller's form of the layer plan (a model config).
      candidate: the chosen :class:`Candidate`.
      n_layers: layers of the model.
      budget_bytes: the budget in bytes.
      names: per-name costs of the block.
      solution: the solver's record (predicted and compiled peak, compiles tried, times).
      none_peak_bytes: compiled peak without remat.
      full_peak_bytes: compiled peak with full remat on every layer.
      step_flops: FLOPs of one step without remat (for the overhead fraction).
      devices: the devices of the step's mesh (1: none). Above 1 the budget and the peaks are per
        device (a compiled SPMD program's peak is one device's share) and the names' bytes global
        (traced values, all devices together); :meth:`table` says so.
      gathered_choice: on a mesh, whether the plan keeps or re-gathers the layers' gathered
        weights and why (``""``: no gathered weights, or no layer rematerialized).
    """

    config: Any
    candidate: Candidate
    n_layers: int
    budget_bytes: int
    names: tuple[NameCost, ...]
    solution: Solution
    none_peak_bytes: int
    full_peak_bytes: int
    step_flops: float
    devices: int = 1
    gathered_choice: str = ""

    @property
    def recompute_fraction(self) -> float:
        """Predicted recompute FLOPs as a fraction of the no-remat step's FLOPs."""
        return self.solution.recompute_flops / self.step_flops if self.step_flops else 0.0

    def table(self) -> str:
        """Every tensor name with its decision, then predicted vs compiled peak and overhead."""
        cand = self.candidate
        mesh = self.devices > 1
        per = " per device" if mesh else ""
        lines = [
            f"auto plan for budget {self.budget_bytes:,} bytes{per} ({format_bytes(self.budget_bytes)})"
            f"{f' on {self.devices} devices' if mesh else ''}: {cand.describe(self.n_layers)}"
            + (f"; {self.gathered_choice}" if self.gathered_choice else "")
        ]
        column = "global B/layer" if mesh else "bytes/layer"
        lines.append(f"  {'tensor':<14} {column:>14} {'recompute FLOPs':>16}  decision")
        for nc in self.names:
            if cand.remat_layers == 0 or nc.name in cand.save:
                decision = "save"
            elif nc.name in cand.offload:
                decision = "offload to host"
            else:
                decision = "recompute"
            lines.append(f"  {nc.name:<14} {nc.bytes:>14,} {nc.recompute_flops:>16,.0f}  {decision}")
        sol = self.solution
        lines.append(
            f"  predicted peak {sol.predicted_peak_bytes:,} B{per}, compiled peak {sol.compiled_peak_bytes:,} B{per} "
            f"(none {self.none_peak_bytes:,} B, full {self.full_peak_bytes:,} B); predicted recompute "
            f"{self.recompute_fraction:.1%} of the step's FLOPs"
            f"{' (offloads priced in FLOP-equivalents)' if cand.offload else ''}; solved in {sol.solve_s * 1e3:.1f} ms "
            f"+ {len(sol.compiled)} verification compile(s) in {sol.compile_s:.1f} s"
        )
        return "\n".join(lines)


def plan_layers(
    budget: str | Budget,
    *,
    costs: Sequence[NameCost],
    n_layers: int,
    block_input_bytes: int,
    none_layer_bytes: int,
    measure_peak_bytes: Callable[[Candidate], int],
    apply: Callable[[Candidate], Any] = lambda c: c,
    step_flops: float = 0.0,
    offload_cost_per_byte: float | None = None,
    regather_flops: float = 0.0,
    devices: int = 1,
    keep_gathered: bool | None = None,
    keep_key: str = "keep_gathered",
) -> LayerPlan:
    """The least-recompute layer plan whose measured step peak fits ``budget``.

    Decision space: which of ``costs`` to save x how many layers, from the first, to
    rematerialize. Prediction: the compiled peaks without remat and with full remat calibrate how
    the peak moves per traced residual byte; every plan is priced from its kept bytes.

    Args:
      budget: bytes, or a fraction in ``(0, 1]`` of the way from full remat's peak to no remat's.
      costs: per-layer units of the block (:func:`name_costs`).
      n_layers: layers of the model.
      block_input_bytes: bytes of one block's input (kept by every rematerialized layer).
      none_layer_bytes: residual bytes of one block without remat.
      measure_peak_bytes: compiles the step under a plan and returns its peak.
      apply: turns a :class:`Candidate` into the caller's form, kept as :attr:`LayerPlan.config`.
      step_flops: FLOPs of the step without remat (for :attr:`LayerPlan.recompute_fraction`).
      offload_cost_per_byte: FLOP-equivalents per byte moved to the host and back; ``None``:
        no offloading.
      regather_flops: on a mesh, FLOP-equivalents of gathering one layer's weights again in the
        backward pass (:func:`jremat.collective_flops_per_byte` times their bytes), charged to every
        rematerialized layer that does not keep them (``keep_gathered``); the peak of full remat
        keeping them all is measured too, to price keeping them per layer. ``0`` (default): no
        mesh, no such candidates.
      devices: the devices of the step's mesh: above 1, ``budget`` and ``measure_peak_bytes`` are
        per device (as a sharded step's compiled peak is) and :meth:`LayerPlan.table` says so;
        ``costs`` and the layer bytes may be global (traced values), the prediction being
        calibrated on the measured peaks.
      keep_gathered: ``True``: only plans whose rematerialized layers keep their gathered weights;
        ``False``: only plans that gather them again; ``None`` (default): both when
        ``regather_flops`` is positive, the cheaper that fits chosen.
        :attr:`LayerPlan.gathered_choice` says which the plan does and why.
      keep_key: the key the keeping plans set (``"keep_gathered"``, or ``"keep_collectives"``
        where ``regather_flops`` prices other collectives too, as an expert-parallel MoE's
        all-to-alls).

    Raises:
      ValueError: on a bad budget, when no plan fits (with the smallest achievable peak; with
        ``keep_gathered`` given, among the plans it allows), or when ``devices`` is not a
        positive integer.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    budget = as_budget(budget)
    if offload_cost_per_byte is not None:
        costs = tuple(dataclasses.replace(c, offload_flops=c.bytes * offload_cost_per_byte) for c in costs)
    costs = tuple(costs)
    none_cand, full_cand = Candidate((), 0), Candidate((), n_layers)
    none_peak, full_peak = int(measure_peak_bytes(none_cand)), int(measure_peak_bytes(full_cand))
    kept_cand = Candidate((), n_layers, (), True, keep_key)
    keeping = (False, True) if keep_gathered is None else (keep_gathered,)
    if regather_flops <= 0 and keep_gathered is None:
        keeping = (False,)
    kept_peak = int(measure_peak_bytes(kept_cand)) if True in keeping else full_peak
    gathered_per_layer = max(kept_peak - full_peak, 0) / n_layers
    traced_span = max(none_layer_bytes - block_input_bytes, 1)
    bytes_per_traced_byte = max(none_peak - full_peak, 0) / (n_layers * traced_span)
    by_name = {c.name: c for c in costs}

    def predict(cand: Candidate) -> int:
        if cand.remat_layers == 0:
            return none_peak
        kept = min(block_input_bytes + sum(by_name[n].bytes for n in cand.save), none_layer_bytes)
        extra = cand.remat_layers * (kept - block_input_bytes) + (n_layers - cand.remat_layers) * traced_span
        gathered = cand.remat_layers * gathered_per_layer if cand.keep_gathered else 0
        return int(full_peak + bytes_per_traced_byte * extra + gathered)

    def cost(cand: Candidate) -> float:
        regather = 0.0 if cand.keep_gathered else regather_flops
        return cand.remat_layers * (sum(c.unsaved_flops for c in costs if c.name not in cand.save) + regather)

    def measure(cand: Candidate) -> int:
        known = {none_cand: none_peak, full_cand: full_peak, kept_cand: kept_peak}
        return known[cand] if cand in known else measure_peak_bytes(cand)

    candidates = [none_cand]
    for subset in save_sets(costs):
        moved = tuple(c.name for c in costs if c.offloaded and c.name not in subset)
        candidates.extend(
            Candidate(subset, g, moved, keep, keep_key) for keep in keeping for g in range(1, n_layers + 1)
        )
    budget_bytes = budget.resolve(none_peak, floor_bytes=full_peak if budget.fraction is not None else 0)
    try:
        solution = solve(
            budget_bytes,
            candidates,
            predict_peak_bytes=predict,
            recompute_flops=cost,
            measure_peak_bytes=measure,
            describe=lambda c: c.describe(n_layers),
        )
    except ValueError as err:
        if keep_gathered is None:
            raise
        raise ValueError(f"keep_gathered={str(keep_gathered).lower()}: {err}") from None
    return LayerPlan(
        config=apply(solution.candidate),
        candidate=solution.candidate,
        n_layers=n_layers,
        budget_bytes=budget_bytes,
        names=costs,
        solution=solution,
        none_peak_bytes=none_peak,
        full_peak_bytes=full_peak,
        step_flops=step_flops,
        devices=devices,
        gathered_choice=_gathered_choice(
            solution.candidate, keep_gathered, regather_flops, budget_bytes, kept_peak, keep_key
        ),
    )


def _gathered_choice(
    chosen: Candidate,
    keep_gathered: bool | None,
    regather_flops: float,
    budget_bytes: int,
    kept_peak_bytes: int,
    keep_key: str = "keep_gathered",
) -> str:
    """:attr:`LayerPlan.gathered_choice` of ``chosen``."""
    if chosen.remat_layers == 0 or (regather_flops <= 0 and keep_gathered is None):
        return ""
    weights = keep_key == "keep_gathered"
    kept, again = ("gathered weights", "re-gathers weights") if weights else ("collectives", "re-issues collectives")
    unit = "re-gathering a layer's weights" if weights else "re-issuing a layer's collectives"
    if keep_gathered is not None:
        verb, value = (f"keeps {kept}", "true") if keep_gathered else (again, "false")
        return f"{verb}, as asked ({keep_key}={value})"
    if chosen.keep_gathered:
        return (
            f"keeps {kept}: cheaper than {unit.split(' a layer')[0]} them ({regather_flops:,.0f} FLOP-equivalents "
            "per layer) within the budget"
        )
    if kept_peak_bytes > budget_bytes:
        return (
            f"{again}: keeping them does not fit the budget of {budget_bytes:,} B "
            f"(full remat keeping them peaks at {kept_peak_bytes:,} B)"
        )
    return f"{again}: cheaper than keeping them within the budget ({unit} priced at {regather_flops:,.0f} FLOP-equivalents)"


__all__ = [
    "ALWAYS_KEPT",
    "Budget",
    "Candidate",
    "EXHAUSTIVE_UNITS",
    "LayerPlan",
    "NameCost",
    "Solution",
    "as_budget",
    "name_costs",
    "ops_to_keep_within_budget",
    "parse_budget",
    "plan_function",
    "plan_layers",
    "save_sets",
    "solve",
]
