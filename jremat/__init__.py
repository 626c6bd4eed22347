"""jremat: activation rematerialization for JAX with fine-grained policies.

The public API is the names below, plus the public submodules :mod:`jremat.registry`,
:mod:`jremat.names`, :mod:`jremat.ops`, :mod:`jremat.testing` and :mod:`jremat.pytest_plugin`
(a pytest plugin). Every other module is private (``jremat._...``).
"""

# Public submodules: the policy registry, the reference model's tensor names, remat-aware ops.
from jremat import names as names
from jremat import ops as ops
from jremat import registry as registry

# Memory budgets: sizes and fractions such as "6GiB" or 0.5.
from jremat._budget import Budget as Budget
from jremat._budget import parse_budget as parse_budget

# Compiling: jit with the XLA options under which remat's savings survive.
from jremat._compile import compiler_options as compiler_options
from jremat._compile import jit as jit

# Decorators: a policy applied to a function or module, and custom policies.
from jremat._decorator import checkpoint as checkpoint
from jremat._decorator import custom_policy as custom_policy
from jremat._decorator import policy as policy

# What a policy did to a function: each decision, the names it matched, whether memory fell.
from jremat._explain import Explanation as Explanation
from jremat._explain import explain as explain
from jremat._explain import explain_applied as explain_applied

# FLOPs of traced programs (scan bodies times their length).
from jremat._flops import jaxpr_flops as jaxpr_flops
from jremat._flops import program_flops as program_flops

# Host offload: whether the backend has host memory, and its cost in FLOPs per byte.
from jremat._host_offload import host_offload_available as host_offload_available
from jremat._host_offload import offload_flops_per_byte as offload_flops_per_byte

# The allocator's live peak of a real run.
from jremat._live import LiveMemory as LiveMemory
from jremat._live import allocator_stats_missing as allocator_stats_missing
from jremat._live import live_memory as live_memory

# Memory: compiled reports and the remat diagnosis.
from jremat._memory import MemoryReport as MemoryReport
from jremat._memory import compiled_memory_report as compiled_memory_report
from jremat._memory import diagnose_remat as diagnose_remat
from jremat._memory import format_bytes as format_bytes
from jremat._memory import memory_report as memory_report

# The budget planner: per-layer and per-name choices under a memory budget.
from jremat._planner import Candidate as Candidate
from jremat._planner import LayerPlan as LayerPlan
from jremat._planner import NameCost as NameCost
from jremat._planner import name_costs as name_costs
from jremat._planner import plan_function as plan_function
from jremat._planner import plan_layers as plan_layers

# Policies: the base classes, the plan a plan policy returns, and the offload precondition.
from jremat._policy import CallbackPolicy as CallbackPolicy
from jremat._policy import NoRemat as NoRemat
from jremat._policy import Plan as Plan
from jremat._policy import PlanPolicy as PlanPolicy
from jremat._policy import Policy as Policy
from jremat._policy import require_host_memory as require_host_memory

# Programs: the traced equations a plan policy chooses from.
from jremat._program import Op as Op
from jremat._program import Program as Program
from jremat._program import trace_program as trace_program

# Layer stacks: where remat applies, scanned or unrolled layers, chunked recomputation.
from jremat._remat import GRANULARITIES as GRANULARITIES
from jremat._remat import RematConfig as RematConfig
from jremat._remat import remat_at as remat_at
from jremat._remat import rematerialized_chunks as rematerialized_chunks
from jremat._remat import run_layers as run_layers

# What a policy keeps: saved residuals.
from jremat._residuals import ResidualsReport as ResidualsReport
from jremat._residuals import saved_residuals_report as saved_residuals_report

# Randomness that recomputes identically.
from jremat._rng import dropout as dropout
from jremat._rng import layer_keys as layer_keys
from jremat._rng import site_key as site_key

# The memory timeline: live bytes over the compiled schedule.
from jremat._timeline import MemoryTimeline as MemoryTimeline
from jremat._timeline import TimelineBuffer as TimelineBuffer
from jremat._timeline import build_timeline as build_timeline
from jremat._timeline import memory_timeline as memory_timeline

# The policy registry: specs, parameters, registration and lookup.
from jremat.registry import Param as Param
from jremat.registry import available as available
from jremat.registry import describe as describe
from jremat.registry import load_module as load_module
from jremat.registry import register as register
from jremat.registry import resolve as resolve

__all__ = [
    "Budget",
    "CallbackPolicy",
    "Candidate",
    "Explanation",
    "GRANULARITIES",
    "LayerPlan",
    "LiveMemory",
    "MemoryReport",
    "MemoryTimeline",
    "NameCost",
    "NoRemat",
    "Op",
    "Param",
    "Plan",
    "PlanPolicy",
    "Policy",
    "Program",
    "RematConfig",
    "ResidualsReport",
    "TimelineBuffer",
    "allocator_stats_missing",
    "available",
    "build_timeline",
    "checkpoint",
    "compiled_memory_report",
    "compiler_options",
    "custom_policy",
    "describe",
    "diagnose_remat",
    "dropout",
    "explain",
    "explain_applied",
    "format_bytes",
    "host_offload_available",
    "jaxpr_flops",
    "jit",
    "layer_keys",
    "live_memory",
    "load_module",
    "memory_report",
    "memory_timeline",
    "name_costs",
    "names",
    "offload_flops_per_byte",
    "ops",
    "parse_budget",
    "plan_function",
    "plan_layers",
    "policy",
    "program_flops",
    "register",
    "registry",
    "remat_at",
    "rematerialized_chunks",
    "require_host_memory",
    "resolve",
    "run_layers",
    "saved_residuals_report",
    "site_key",
    "trace_program",
]
