"""jremat: activation rematerialization for JAX with fine-grained policies.

The public API is the names below, plus the public submodules :mod:`jremat.registry`,
:mod:`jremat.names`, :mod:`jremat.ops`, :mod:`jremat.attention` (memory-efficient attention),
:mod:`jremat.kernels` (kernels such as Pallas attention, recognised and kept), :mod:`jremat.testing`, :mod:`jremat.pytest_plugin`
(a pytest plugin), the namespaces :mod:`jremat.diagnosis` (explain, memory, residuals,
collectives, timeline, counts) and :mod:`jremat.fit` (the fit search, the batch search, budgets),
whose names that are also below are the same objects, :mod:`jremat.internal` (what the
command-line tools use, without a stability promise), :mod:`jremat.policies` (the built-in policies) and, with the ``[train]``
extra, :mod:`jremat.models` (the reference GPT) and :mod:`jremat.train` (the command-line
tools). Every other module is private (``jremat._...``).

The names are loaded on first use (PEP 562), so ``import jremat`` and the pytest plugin import
no JAX until something is used.

What a policy saves is decided in :mod:`jremat._apply.policy` (the kinds of :class:`Policy`: a
:class:`PlanPolicy`'s :meth:`~PlanPolicy.plan` of the whole program, or a JAX callback asked
per equation), a callback's answer read by :func:`jremat._engine.tags.callback_decision`; each
built-in policy's choice is in its module under :mod:`jremat.policies`.
"""

import importlib as _importlib
import threading as _threading
from typing import TYPE_CHECKING

from jremat._version import __version__ as __version__

#: Every public name, by the module that defines it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    # Public submodules (beside the registry, below): the reference model's tensor names, remat-aware ops.
    "jremat.names": (),
    "jremat.ops": (),
    # Memory-efficient attention whose residuals carry names, and a count of fused forward passes.
    "jremat.attention": ("blockwise_attention", "count_forward_passes"),
    # Kernels the library did not write (Pallas, FFI, custom_vjp): recognised, kept, priced.
    "jremat.kernels": (),
    # Memory budgets: sizes and fractions such as "6GiB" or 0.5.
    "jremat._spec.budget": ("Budget", "format_bytes", "parse_budget"),
    # Collectives of a compiled program on a mesh, and what a policy re-issues.
    "jremat._measure.collectives": (
        "Collective",
        "CollectivesReport",
        "collective_flops_per_byte",
        "collective_s_per_byte",
        "collectives_report",
        "compiled_collectives_report",
    ),
    # Compiling: jit with the XLA options under which remat's savings survive.
    "jremat._measure.compile": ("compiler_options", "jit"),
    # Decorators: a policy applied to a function or module, and custom policies.
    "jremat._apply.decorator": ("checkpoint", "custom_policy", "filter_checkpoint", "policy"),
    # The diagnosis tools (explain, the memory, residuals, collectives and timeline reports, counts) in one namespace.
    "jremat.diagnosis": (),
    # What a policy did to a function: each decision, the names it matched, whether memory fell.
    "jremat._explain.explain": ("Explanation", "explain", "explain_applied"),
    # Throughput at a memory budget: the (policy, batch) that trains fastest, measured.
    # (All of it, with the batch search and budgets, is the namespace jremat.fit.)
    "jremat.fit": (),
    "jremat._plan.fit": (
        "fit_search",
        "fit_search_budgets",
        "keep_collectives_variants",
        "keep_gathered_variants",
        "measure_throughput",
    ),
    "jremat._plan.time_model": ("calibrate_time_model", "with_collective_rates"),
    "jremat._plan.fit_types": ("FitError", "FitProbe", "FitResult", "FitRow", "FitStep", "TimeModel"),
    # FLOPs of traced programs (scan bodies times their length).
    "jremat._program.flops": ("jaxpr_flops", "program_flops"),
    # Kernels (pallas_call, FFI calls): their price for every policy and analysis, and declaring one.
    "jremat._program.kernel_cost": ("KernelCost", "kernel_cost", "register_kernel", "unregister_kernel"),
    # Host offload: whether the backend has host memory, and its cost in FLOPs per byte.
    "jremat._measure.host_offload": ("host_offload_available", "offload_flops_per_byte"),
    # The allocator's live peak of a real run.
    "jremat._measure.live": ("LiveMemory", "allocator_stats_missing", "live_memory"),
    # Memory: compiled reports and the remat diagnosis.
    "jremat._measure.memory": (
        "MemoryReport",
        "compiled_memory_report",
        "diagnose_remat",
        "memory_report",
    ),
    # The budget planner: per-layer and per-name choices under a memory budget.
    "jremat._plan.planner": (
        "Candidate",
        "LayerPlan",
        "NameCost",
        "name_costs",
        "ops_to_keep_within_budget",
        "plan_function",  # alias of ops_to_keep_within_budget
        "plan_layers",
    ),
    # Policies: the base classes, the plan a plan policy returns, and the offload precondition.
    "jremat._apply.policy": (
        "CallbackPolicy",
        "NoRemat",
        "Plan",
        "PlanPolicy",
        "Policy",
        "PolicyDoesNotApply",
        "require_host_memory",
    ),
    # Programs: the traced equations a plan policy chooses from.
    "jremat._program.program": ("Op", "Program", "trace_program"),
    # Layer stacks: where remat applies, scanned or unrolled layers, chunked recomputation.
    "jremat._spec.granularity": ("GRANULARITIES",),
    "jremat._apply.layers": ("RematConfig", "remat_at", "rematerialized_chunks", "run_layers"),
    # What a policy keeps: saved residuals.
    "jremat._explain.residuals": ("ResidualsReport", "saved_residuals_report"),
    # Randomness that recomputes identically.
    "jremat._apply.rng": ("dropout", "layer_keys", "site_key"),
    # The memory timeline: live bytes over the compiled schedule.
    "jremat._measure.timeline": ("MemoryTimeline", "TimelineBuffer", "build_timeline", "memory_timeline"),
    # The policy registry (a public submodule): specs, parameters, registration and lookup.
    "jremat.registry": ("Param", "available", "describe", "load_module", "register", "resolve"),
}
if TYPE_CHECKING:
    # The same names for type checkers and IDEs (kept equal to _EXPORTS by tests/jremat/test_public_api.py).
    from jremat import attention as attention
    from jremat import diagnosis as diagnosis
    from jremat import fit as fit
    from jremat import kernels as kernels
    from jremat import names as names
    from jremat import ops as ops
    from jremat import registry as registry
    from jremat._apply.decorator import checkpoint as checkpoint
    from jremat._apply.decorator import custom_policy as custom_policy
    from jremat._apply.decorator import filter_checkpoint as filter_checkpoint
    from jremat._apply.decorator import policy as policy
    from jremat._apply.layers import RematConfig as RematConfig
    from jremat._apply.layers import remat_at as remat_at
    from jremat._apply.layers import rematerialized_chunks as rematerialized_chunks
    from jremat._apply.layers import run_layers as run_layers
    from jremat._apply.policy import CallbackPolicy as CallbackPolicy
    from jremat._apply.policy import NoRemat as NoRemat
    from jremat._apply.policy import Plan as Plan
    from jremat._apply.policy import PlanPolicy as PlanPolicy
    from jremat._apply.policy import Policy as Policy
    from jremat._apply.policy import PolicyDoesNotApply as PolicyDoesNotApply
    from jremat._apply.policy import require_host_memory as require_host_memory
    from jremat._apply.rng import dropout as dropout
    from jremat._apply.rng import layer_keys as layer_keys
    from jremat._apply.rng import site_key as site_key
    from jremat._explain.explain import Explanation as Explanation
    from jremat._explain.explain import explain as explain
    from jremat._explain.explain import explain_applied as explain_applied
    from jremat._explain.residuals import ResidualsReport as ResidualsReport
    from jremat._explain.residuals import saved_residuals_report as saved_residuals_report
    from jremat._measure.collectives import Collective as Collective
    from jremat._measure.collectives import CollectivesReport as CollectivesReport
    from jremat._measure.collectives import collective_flops_per_byte as collective_flops_per_byte
    from jremat._measure.collectives import collective_s_per_byte as collective_s_per_byte
    from jremat._measure.collectives import collectives_report as collectives_report
    from jremat._measure.collectives import compiled_collectives_report as compiled_collectives_report
    from jremat._measure.compile import compiler_options as compiler_options
    from jremat._measure.compile import jit as jit
    from jremat._measure.host_offload import host_offload_available as host_offload_available
    from jremat._measure.host_offload import offload_flops_per_byte as offload_flops_per_byte
    from jremat._measure.live import LiveMemory as LiveMemory
    from jremat._measure.live import allocator_stats_missing as allocator_stats_missing
    from jremat._measure.live import live_memory as live_memory
    from jremat._measure.memory import MemoryReport as MemoryReport
    from jremat._measure.memory import compiled_memory_report as compiled_memory_report
    from jremat._measure.memory import diagnose_remat as diagnose_remat
    from jremat._measure.memory import memory_report as memory_report
    from jremat._measure.timeline import MemoryTimeline as MemoryTimeline
    from jremat._measure.timeline import TimelineBuffer as TimelineBuffer
    from jremat._measure.timeline import build_timeline as build_timeline
    from jremat._measure.timeline import memory_timeline as memory_timeline
    from jremat._plan.fit import fit_search as fit_search
    from jremat._plan.fit import fit_search_budgets as fit_search_budgets
    from jremat._plan.fit import keep_collectives_variants as keep_collectives_variants
    from jremat._plan.fit import keep_gathered_variants as keep_gathered_variants
    from jremat._plan.fit import measure_throughput as measure_throughput
    from jremat._plan.fit_types import FitError as FitError
    from jremat._plan.fit_types import FitProbe as FitProbe
    from jremat._plan.fit_types import FitResult as FitResult
    from jremat._plan.fit_types import FitRow as FitRow
    from jremat._plan.fit_types import FitStep as FitStep
    from jremat._plan.fit_types import TimeModel as TimeModel
    from jremat._plan.planner import Candidate as Candidate
    from jremat._plan.planner import LayerPlan as LayerPlan
    from jremat._plan.planner import NameCost as NameCost
    from jremat._plan.planner import name_costs as name_costs
    from jremat._plan.planner import ops_to_keep_within_budget as ops_to_keep_within_budget
    from jremat._plan.planner import plan_function as plan_function
    from jremat._plan.planner import plan_layers as plan_layers
    from jremat._plan.time_model import calibrate_time_model as calibrate_time_model
    from jremat._plan.time_model import with_collective_rates as with_collective_rates
    from jremat._program.flops import jaxpr_flops as jaxpr_flops
    from jremat._program.flops import program_flops as program_flops
    from jremat._program.kernel_cost import KernelCost as KernelCost
    from jremat._program.kernel_cost import kernel_cost as kernel_cost
    from jremat._program.kernel_cost import register_kernel as register_kernel
    from jremat._program.kernel_cost import unregister_kernel as unregister_kernel
    from jremat._program.program import Op as Op
    from jremat._program.program import Program as Program
    from jremat._program.program import trace_program as trace_program
    from jremat._spec.budget import Budget as Budget
    from jremat._spec.budget import format_bytes as format_bytes
    from jremat._spec.budget import parse_budget as parse_budget
    from jremat._spec.granularity import GRANULARITIES as GRANULARITIES
    from jremat.attention import blockwise_attention as blockwise_attention
    from jremat.attention import count_forward_passes as count_forward_passes
    from jremat.registry import Param as Param
    from jremat.registry import available as available
    from jremat.registry import describe as describe
    from jremat.registry import load_module as load_module
    from jremat.registry import register as register
    from jremat.registry import resolve as resolve

_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_WHERE.update({module.rpartition(".")[2]: module for module in _EXPORTS if not module.startswith("jremat._")})

__all__ = sorted(_WHERE)


_jax_import_lock = _threading.Lock()
#: Modules behind public names that import no JAX (tests/jremat/test_threads.py checks it).
_JAX_FREE = frozenset({"jremat._spec.budget", "jremat._spec.granularity", "jremat.registry"})


def _import_jax_once() -> None:
    # JAX's first import from several threads at once can fail (a partly initialized jax module
    # is handed to a thread that Python's import deadlock check suspects); jremat's threads
    # import it one at a time, holding no other lock.
    with _jax_import_lock:
        import jax  # noqa: F401


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jremat' has no attribute {name!r}")
    if module not in _JAX_FREE:
        _import_jax_once()
    loaded = _importlib.import_module(module)
    value = loaded if module == f"jremat.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
